"""A PyTorch CNN on Fashion-MNIST, trained through falcon. The same script runs on every rank.

Launched by torchrun (or Slurm, mpirun, or with FALCON_*/DMLC_* variables), every rank is
the worker of its rank; rank 0 also hosts falcon's scheduler and server on threads. On one
host, 4 workers with worker 3 at a quarter of the speed, under EPSP:

    FALCON_POLICY=epsp FALCON_HETERO=3:h=0.25 FALCON_LR=0.2 \\
        python3 -m torch.distributed.run --nproc_per_node 4 examples/torch_fashion_mnist.py

Two ways to train:

- `--mode fit` (default): `falcon.torch.fit`, the task-driven trainer: falcon owns the
  iteration, and a worker the policy holds back computes a straggler's unstarted tasks
  (task transfer). FALCON_HETERO is applied by `fit`.
- `--mode optimizer`: `falcon.torch.DistributedOptimizer` around a torch.optim optimizer
  that matches the job's (FALCON_OPTIMIZER, FALCON_LR), with a plain training loop over
  this worker's shard of the data (every W-th example). FALCON_HETERO is applied here,
  after each step, the way `fit` applies it.

The data: `falcon.fashion_mnist()`: the sample bundled with falcon's sources (5000 training
and 1000 test images), Debian's full set where the package dataset-fashion-mnist is
installed, or `--data DIR` (the four idx files, gzipped or not).

Worker rank 0 evaluates the final values on the test set and prints `ACCURACY <float>` and a
JSON line `SUMMARY {...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import falcon
import falcon.torch as ft


class Net(nn.Module):
    """A small LeNet-style CNN: two 5×5 convolutions with max pooling, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5)  # 28 → 24, pooled 12
        self.conv2 = nn.Conv2d(8, 16, 5)  # 12 → 8, pooled 4
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("fit", "optimizer"), default="fit",
                   help="fit: the task-driven trainer (default); optimizer: "
                        "DistributedOptimizer and a plain training loop")
    p.add_argument("--iterations", type=int, default=500,
                   help="iterations (clocks) of each worker (default 500)")
    p.add_argument("--batch", type=int, default=64, help="examples per worker per iteration")
    p.add_argument("--tasks", type=int, default=4, help="tasks per iteration (fit mode)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (fit mode: the start; falcon's parallelism "
                        "manager may change it)")
    p.add_argument("--data", default=None, help="a directory with Fashion-MNIST's idx files")
    p.add_argument("--seed", type=int, default=1, help="the model's and the data order's seed")
    p.add_argument("--no-transfer", action="store_true", help="fit mode: no task transfer")
    return p.parse_args(argv)


def torch_optimizer_of(job: dict, params) -> torch.optim.Optimizer:
    """The torch.optim optimizer that describes the job's servers' rule."""
    kind, lr = job["optimizer"], float(job["lr"])
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=float(job["momentum"]))
    if kind == "adam":
        b1, b2 = job["betas"]
        return torch.optim.Adam(params, lr=lr, betas=(float(b1), float(b2)), eps=float(job["eps"]))
    raise SystemExit(f"the job's servers apply {kind}, which this example cannot mirror")


def train_fit(args, model, x, y) -> dict:
    s = ft.fit(
        model, F.cross_entropy, (x, y), iterations=args.iterations, batch=args.batch,
        tasks=args.tasks, seed=args.seed, transfer=not args.no_transfer, threads=args.threads,
    )
    threads = s.pop("threads", [])
    s.pop("snapshots", None)
    s["threads_last"] = threads[-1] if threads else None
    return dict(s)


def train_optimizer(args, model, x, y) -> dict:
    # Join with the model's parameters, then mirror the job's optimizer in torch.optim.
    w = falcon.init(dict(model.named_parameters()))
    opt = ft.DistributedOptimizer(
        torch_optimizer_of(w.job, model.parameters()), model.named_parameters()
    )
    workers, rank = w.workers, w.rank
    shard = torch.arange(rank, len(x), workers)  # this worker's examples
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    order, pos, epoch = shard[torch.randperm(len(shard), generator=g)], 0, 0
    spec = ft.heterogeneity(None, workers, rank, args.seed)
    start = time.perf_counter()
    compute = injected = 0.0
    loss = None
    model.train()
    for it in range(args.iterations):
        if pos + args.batch > len(order):  # a new epoch of the shard
            order, pos, epoch = shard[torch.randperm(len(shard), generator=g)], 0, epoch + 1
        idx = order[pos : pos + args.batch]
        pos += args.batch
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()  # the gradient hooks push as each gradient is ready
        opt.step()  # waits for the pushes, pulls the values the policy allows
        dt = time.perf_counter() - t0
        compute += dt
        if spec is not None:
            d = spec.delay(it, dt)
            if d > 0:
                time.sleep(d)
                injected += d
    return {
        "rank": rank, "iterations": args.iterations, "secs": time.perf_counter() - start,
        "step_s": compute, "injected_s": injected, "epochs": epoch,
        "last_loss": None if loss is None else loss.item(),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    (tx, ty), (vx, vy), source = falcon.fashion_mnist(args.data)
    x, y = torch.from_numpy(tx).unsqueeze(1), torch.from_numpy(ty).long()
    test = (torch.from_numpy(vx).unsqueeze(1), torch.from_numpy(vy).long())
    model = Net()  # the same initial values everywhere; the servers start from rank 0's

    if args.mode == "fit":
        falcon.init()  # rank 0 also hosts the scheduler and the server
        summary = train_fit(args, model, x, y)
    else:
        summary = train_optimizer(args, model, x, y)
    w = falcon.worker()
    rank, workers, job = w.rank, w.workers, w.job
    falcon.finish()

    if rank == 0:
        acc = ft.evaluate(model, nn.utils.parameters_to_vector(model.parameters()), test)
        summary.update(
            mode=args.mode, policy=job["policy"], optimizer=job["optimizer"], lr=job["lr"],
            workers=workers, hetero=os.environ.get("FALCON_HETERO", ""), batch=args.batch,
            data=source, train_examples=len(x), test_examples=len(test[0]), accuracy=acc,
        )
        # Each line in one write: other processes share this output, and print() writes a
        # line's text and its newline separately where the stream is unbuffered.
        sys.stdout.write(f"ACCURACY {acc:.4f}\n")
        sys.stdout.write("SUMMARY " + json.dumps(summary, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        sys.stderr.write(f"worker {rank}: {summary['iterations']} iterations in "
                         f"{summary['secs']:.1f} s\n")


if __name__ == "__main__":
    main()
