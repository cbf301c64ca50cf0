"""The per-tensor cost of falcon.torch.DistributedOptimizer on a model of many small tensors.

One process, one worker: a local cluster (1 worker, 1 server, BSP) on threads of this
process. A stack of `--layers` Linear(64, 64) layers (2 tensors each: 160 tensors for 80
layers), batch 32, momentum SGD. Two copies of the model, the same initial values, train on
the same batches: plain torch.optim.SGD, and the same SGD wrapped by DistributedOptimizer
(`--mode server`: the servers apply momentum; `--mode local`: each worker its own optimizer).
Rounds alternate (the order flipped every round); each side's figure is the median over
rounds of the round's mean step time; the cost per tensor is (falcon − plain) / tensors.

    python3 python/bench/many_tensors.py [--layers 80] [--rounds 9] [--steps 30] [--mode server|local]
        [--bucket-bytes N | --sweep]

`--bucket-bytes N`: DistributedOptimizer's buckets (0: one tensor per parameter; default:
falcon.torch.BUCKET_BYTES). `--sweep`: one run per bucket size, each in a process of its own,
and a table of them all.

Prints a Markdown table and, last, one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import falcon
import falcon.torch as ft


def model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def steps(m, opt, x, y, n) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", choices=("server", "local"), default="server")
    ap.add_argument("--bucket-bytes", type=int, default=None)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args)
    torch.set_num_threads(1)
    plain, wrapped = model(args.layers), model(args.layers)
    tensors = len(list(plain.parameters()))
    popt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    base = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    s = ft.optimizer_settings(base, local=True) if args.mode == "local" else ft.optimizer_settings(base)
    c = falcon.local_cluster(workers=1, policy="bsp", optimizer=s["FALCON_OPTIMIZER"], lr=s["FALCON_LR"])
    falcon.init(env=c.env)
    dopt = ft.DistributedOptimizer(base, wrapped.named_parameters(), bucket_bytes=args.bucket_bytes)
    buckets = len(dopt.buckets)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    steps(plain, popt, x, y, 5)
    steps(wrapped, dopt, x, y, 5)
    per = {"plain": [], "falcon": []}
    for r in range(args.rounds):
        order = (("plain", plain, popt), ("falcon", wrapped, dopt))
        for name, m, o in order if r % 2 == 0 else order[::-1]:
            per[name].append(steps(m, o, x, y, args.steps))
    p, f = statistics.median(per["plain"]), statistics.median(per["falcon"])
    us = (f - p) / tensors * 1e6
    falcon.finish()
    c.finish()
    bb = ft.BUCKET_BYTES if args.bucket_bytes is None else args.bucket_bytes
    print(f"{tensors} tensors in {buckets} job tensors (bucket_bytes {bb}), mode {args.mode}, "
          f"{args.rounds} rounds of {args.steps} steps, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| plain step ms | falcon step ms | falcon / plain | µs per tensor per step |")
    print("|---:|---:|---:|---:|")
    print(f"| {p * 1e3:.3f} | {f * 1e3:.3f} | {f / p:.3f} | {us:.1f} |")
    print("RESULT " + json.dumps({"tensors": tensors, "buckets": buckets, "bucket_bytes": bb,
                                  "mode": args.mode, "plain_ms": p * 1e3, "falcon_ms": f * 1e3,
                                  "ratio": f / p, "us_per_tensor": us}))


def sweep(args) -> None:
    rows = []
    for bb in (0, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 25 << 20):
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--mode", args.mode, "--bucket-bytes", str(bb)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1][len("RESULT "):]))
    print(f"{rows[0]['tensors']} tensors, mode {args.mode}, {args.rounds} rounds of {args.steps} "
          f"steps, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| bucket bytes | job tensors | plain step ms | falcon step ms | falcon / plain | µs per tensor per step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bucket_bytes']} | {r['buckets']} | {r['plain_ms']:.3f} | {r['falcon_ms']:.3f} "
              f"| {r['ratio']:.3f} | {r['us_per_tensor']:.1f} |")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
