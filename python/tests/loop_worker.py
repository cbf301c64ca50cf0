"""A worker process training in its own loop with falcon's task transfer, for the tests: joins
the job its environment describes, iterates a `falcon.torch.TaskLoader` over the bundled
Fashion-MNIST sample with a `DistributedOptimizer` (plain SGD on the servers), and prints one
JSON line (`LOOP {...}`): the loader's stats and ledger, the final parameters and the
accuracy.

Arguments: ITERATIONS MODEL SLOW_MS: MODEL mlp, or linear (a loss whose gradient does not
depend on the parameters, so that the final values are known exactly); SLOW_MS sleeps after
each own task's backward on worker 3 (a straggler)."""

import json
import sys
import time

import torch

import falcon
import falcon.torch as ft

BATCH, TASKS = 32, 4


def main() -> None:
    iterations, kind, slow_ms = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(1)
    (tx, ty), (vx, vy), _ = falcon.fashion_mnist()
    x = torch.from_numpy(tx).unsqueeze(1)
    y = torch.from_numpy(ty).long()
    torch.manual_seed(7)
    if kind == "linear":
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1))

        def loss_fn(out, t):
            # Linear in the parameters: the gradient is the mean of ±x, whatever the values.
            return (out.squeeze(1) * (t.float() - 4.5)).mean()
    else:
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )
        loss_fn = torch.nn.functional.cross_entropy
    falcon.init()
    loader = ft.TaskLoader((x, y), BATCH, tasks=TASKS, seed=3, iterations=iterations, ledger=True)
    opt = ft.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), model=model,
        tasks=loader, loss_fn=loss_fn,
    )
    rank = opt.worker.rank
    losses = []
    # The user's loop, as PyTorch's examples write it.
    for inputs, targets in loader:
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if rank == 3 and slow_ms > 0:
            time.sleep(slow_ms / 1000 * len(inputs) / (BATCH / TASKS))
        opt.step()
        losses.append(float(loss))
    values = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
    acc = None
    if kind == "mlp":
        vx_t, vy_t = torch.from_numpy(vx).unsqueeze(1), torch.from_numpy(vy).long()
        with torch.no_grad():
            acc = float((model(vx_t).argmax(1) == vy_t).float().mean())
    out = dict(loader.stats, rank=rank, ledger=loader.ledger, values=values, accuracy=acc,
               losses=losses, clock=opt.clock)
    print("LOOP " + json.dumps(out), flush=True)
    falcon.finish()


if __name__ == "__main__":
    main()
