"""The per-step cost of falcon.torch.DistributedOptimizer against plain PyTorch.

One process, one worker: a local cluster (1 worker, 1 server, BSP, the servers applying the
optimizer's own rule via `optimizer_settings`) on threads of this process. Two copies of
the same CNN (examples/torch_fashion_mnist.py's `Net`, the same initial values) train on the
same batches of Fashion-MNIST: one with torch.optim.SGD, one with the same SGD wrapped by
DistributedOptimizer (backward's hooks push each gradient, step() waits for the pushes and
pulls the new values). Rounds alternate between the two (each round `--steps` steps of
each, the order flipped every round), so that drift of the machine hits both alike; the
figure of each is the median over rounds of the round's mean step time.

    target/pyenv/bin/python python/bench/overhead.py [--rounds 15] [--steps 40] [--batch 64]

Prints a Markdown table and, last, one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import falcon
import falcon.torch as ft

ROOT = Path(__file__).resolve().parents[2]


def example_module():
    """examples/torch_fashion_mnist.py, imported (its CNN)."""
    path = ROOT / "examples" / "torch_fashion_mnist.py"
    spec = importlib.util.spec_from_file_location("torch_fashion_mnist", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def extension_info() -> str:
    """Which build of the extension is loaded (a release build is a fraction of a debug one's
    size), for the record."""
    so = Path(falcon._falcon.__file__)
    st = so.stat()
    return f"{so.name}, {st.st_size / 2**20:.1f} MiB, built {time.strftime('%Y-%m-%d %H:%M', time.localtime(st.st_mtime))}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40, help="steps of each kind per round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps of each kind first")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--data", default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    Net = example_module().Net
    (tx, ty), _, source = falcon.fashion_mnist(args.data)
    x, y = torch.from_numpy(tx).unsqueeze(1), torch.from_numpy(ty).long()

    torch.manual_seed(1)
    plain = Net()
    dist = Net()
    dist.load_state_dict(plain.state_dict())
    opt_plain = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=args.momentum)
    base = torch.optim.SGD(dist.parameters(), lr=args.lr, momentum=args.momentum)
    settings = ft.optimizer_settings(base)

    cluster = falcon.local_cluster(
        workers=1, servers=1, policy="bsp", optimizer=settings["FALCON_OPTIMIZER"],
        lr=float(settings["FALCON_LR"]),
    )
    falcon.init(env=cluster.env)
    opt_dist = ft.DistributedOptimizer(base, dist.named_parameters())

    g = torch.Generator().manual_seed(2)
    n = len(x)
    batches = [torch.randint(0, n, (args.batch,), generator=g) for _ in range(64)]
    pos = {"plain": 0, "falcon": 0}

    def steps(kind: str, k: int) -> float:
        model, opt = (plain, opt_plain) if kind == "plain" else (dist, opt_dist)
        t0 = time.perf_counter()
        for _ in range(k):
            idx = batches[pos[kind] % len(batches)]
            pos[kind] += 1
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        return (time.perf_counter() - t0) / k

    steps("plain", args.warmup)
    steps("falcon", args.warmup)
    # Both copies took the same warm-up batches from the same values: they must agree to
    # float rounding (the servers apply the same SGD), which shows the falcon path does the
    # same work. (Compared later they drift apart: training amplifies rounding differences
    # once a ReLU or max-pool tie falls the other way.)
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(plain.parameters(), dist.parameters()))
    per = {"plain": [], "falcon": []}
    ratios = []
    for r in range(args.rounds):
        order = ("plain", "falcon") if r % 2 == 0 else ("falcon", "plain")
        got = {kind: steps(kind, args.steps) for kind in order}
        for kind, v in got.items():
            per[kind].append(v)
        ratios.append(got["falcon"] / got["plain"])

    falcon.finish()
    cluster.finish(timeout=30)

    med = {k: statistics.median(v) for k, v in per.items()}
    ratio = med["falcon"] / med["plain"]
    params = sum(p.numel() for p in plain.parameters())
    cmd = "target/pyenv/bin/python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:]))
    print(f"## DistributedOptimizer overhead, {datetime.date.today().isoformat()}\n")
    print(f"`{cmd}`\n")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {args.threads} torch thread(s)")
    print(f"- extension: {extension_info()}")
    print(f"- model: examples/torch_fashion_mnist.py's CNN, {params} parameters in "
          f"{len(list(plain.parameters()))} tensors; batch {args.batch}; SGD lr {args.lr}"
          f"{f', momentum {args.momentum}' if args.momentum else ''}; data: {source}")
    print(f"- {args.rounds} rounds × {args.steps} steps of each, alternating; medians over rounds\n")
    print("| optimizer | median step (ms) | min round (ms) | max round (ms) |")
    print("|---|---:|---:|---:|")
    for kind, label in (("plain", "torch.optim.SGD"), ("falcon", "DistributedOptimizer(SGD), 1 worker + 1 server, BSP")):
        v = per[kind]
        print(f"| {label} | {med[kind] * 1e3:.3f} | {min(v) * 1e3:.3f} | {max(v) * 1e3:.3f} |")
    print()
    print(f"Overhead: median falcon / median plain = **{ratio:.3f}** ({(ratio - 1) * 100:+.1f} %); "
          f"median of the per-round ratios {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}–{max(ratios):.3f}). Largest parameter difference "
          f"between the two copies after the {args.warmup} warm-up steps on the same batches: "
          f"{diff:.1e}.")
    print("RESULT " + json.dumps({
        "plain_ms": med["plain"] * 1e3, "falcon_ms": med["falcon"] * 1e3, "ratio": ratio,
        "round_ratio_median": statistics.median(ratios), "max_param_diff": diff,
        "threads": args.threads, "batch": args.batch,
    }))


if __name__ == "__main__":
    main()
