"""A worker process of the task-driven trainer, for the tests: joins the job its environment
describes, trains a small model on the bundled Fashion-MNIST sample with falcon.torch.fit,
and prints its summary as one JSON line (`FIT {...}`), the ledger included.

Arguments: ITERATIONS [MODEL [BATCH]]: MODEL mlp (default) or cnn, BATCH per worker (32)."""

import json
import sys

import torch

import falcon
import falcon.torch as ft


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(7)
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10),
        )
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )


def main() -> None:
    iterations = int(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "mlp"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    torch.set_num_threads(1)
    (tx, ty), (vx, vy), _ = falcon.fashion_mnist()
    x = torch.from_numpy(tx).unsqueeze(1)
    y = torch.from_numpy(ty).long()
    model = model_of(kind)
    falcon.init()
    s = ft.fit(
        model, torch.nn.functional.cross_entropy, (x, y), iterations=iterations, batch=batch,
        tasks=4, ledger=True, snapshot_every=0, threads=1,
    )
    acc = ft.evaluate(model, torch.nn.utils.parameters_to_vector(model.parameters()),
                      (torch.from_numpy(vx).unsqueeze(1), torch.from_numpy(vy).long()))
    s["accuracy"] = acc
    s.pop("snapshots", None)
    print("FIT " + json.dumps(s), flush=True)
    falcon.finish()


if __name__ == "__main__":
    main()
