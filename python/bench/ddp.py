"""falcon beside PyTorch's DistributedDataParallel: the same model, data and loop on the same
number of worker processes of one host, step time and final loss.

Two models: the examples' CNN (examples/torch_fashion_mnist.py's `Net`) on Fashion-MNIST, and
a small causal transformer language model (2 blocks, d = 64, 4 heads, sequences of 32 over 64
tokens) on random token streams. Each worker trains on its own part of every global batch
with AdamW and gradient clipping, the loop written as PyTorch's examples write it:

- DDP: `torch.nn.parallel.DistributedDataParallel` over gloo (`init_process_group` with a
  TCP store on 127.0.0.1), N processes;
- falcon: N worker processes of a falcon job whose workers apply their own optimizer
  (`FALCON_OPTIMIZER=local`, BSP): backward ends with the mean gradient in `.grad`, as
  DDP's does; the scheduler and one server run on threads of this process.

- plain (`--sides ...,plain`): one process, no distribution, training what one worker does
  (its part of each global batch; the whole batch with `--workers 1`): falcon's cost over
  PyTorch itself.

Rounds alternate between the sides (the order rotated every round), so a drift of the machine
hits all alike; each round's figure is the workers' mean step time over the timed steps
(after `--warmup` untimed ones), and each side's figure is the median over rounds. Time to a
loss: the loss of a step is the mean of the workers' losses, smoothed over 5 steps; the
target is the highest final smoothed loss of every distributed run (each reaches it), and a
run's time to it is the wall time from its first step to the first step at or below it.
Every process runs one torch thread.

    python3 python/bench/ddp.py [--model cnn|lm|both] [--workers 2] [--rounds 3] [--steps 30]
        [--sides ddp,falcon[,plain]] [--cpu-quota RANKS:CPUS[,...]]

`--cpu-quota 1:0.25` holds worker 1's process (on every side) to a quarter of one CPU in a
control group of its own (`falcon.CpuQuota`: a slow machine the kernel enforces); where
cgroups are not writable the run stops saying so.

Prints a Markdown table and, last, one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LM(torch.nn.Module):
    """A small causal transformer language model."""

    def __init__(self, vocab=64, d=64, heads=4, blocks=2, seq=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(seq, d))
        layer = lambda: torch.nn.TransformerEncoderLayer(  # noqa: E731
            d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.ModuleList(layer() for _ in range(blocks))
        self.out = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h, src_mask=self.mask)
        return self.out(h)


def model_and_data(kind: str):
    """The model (the same initial values everywhere), the global batches' inputs and targets,
    and the loss."""
    torch.manual_seed(1)
    if kind == "cnn":
        path = ROOT / "examples" / "torch_fashion_mnist.py"
        spec = importlib.util.spec_from_file_location("torch_fashion_mnist", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import falcon

        (tx, ty), _, _ = falcon.fashion_mnist(None)
        x, y = torch.from_numpy(tx).unsqueeze(1), torch.from_numpy(ty).long()
        return mod.Net(), x, y, F.cross_entropy
    g = torch.Generator().manual_seed(2)
    stream = torch.randint(0, 64, (4096, 33), generator=g)
    return (
        LM(),
        stream[:, :-1],
        stream[:, 1:],
        lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1)),
    )


def train(rank, workers, kind, args, model, opt, x, y, loss_fn):
    """The loop, timed: this worker's part of each global batch."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    times, loss, losses, clock = [], None, [], []
    start = time.perf_counter()
    for step in range(args.warmup + args.steps):
        at = (step * args.batch) % (len(x) - args.batch)
        idx = torch.arange(at, at + args.batch)[rank::workers]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        t1 = time.perf_counter()
        if step >= args.warmup:
            times.append(t1 - t0)
        losses.append(float(loss))
        clock.append(t1 - start)
    return statistics.mean(times), float(loss), losses, clock


def ddp_worker(rank, workers, kind, args, port, out):
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers
    )
    model, x, y, loss_fn = model_and_data(kind)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    out.put(("ddp", rank, *train(rank, workers, kind, args, ddp, opt, x, y, loss_fn)))
    dist.destroy_process_group()


def plain_worker(rank, workers, kind, args, out):
    torch.set_num_threads(1)
    model, x, y, loss_fn = model_and_data(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    out.put(("plain", rank, *train(rank, workers, kind, args, model, opt, x, y, loss_fn)))


def falcon_worker(rank, workers, kind, args, env, out):
    torch.set_num_threads(1)
    import falcon
    import falcon.torch as ft

    falcon.init(env={**env, "FALCON_ROLE": "worker", "FALCON_RANK": str(rank)})
    model, x, y, loss_fn = model_and_data(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = ft.DistributedOptimizer(opt, model.named_parameters())
    out.put(("falcon", rank, *train(rank, workers, kind, args, model, opt, x, y, loss_fn)))
    falcon.finish()


def run(side, kind, args):
    """One job of `side`: the workers' mean step time (s) and their final losses."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cluster = None
    if side == "plain":
        procs = [ctx.Process(target=plain_worker, args=(0, args.workers, kind, args, out))]
    elif side == "ddp":
        port = free_port()
        procs = [
            ctx.Process(target=ddp_worker, args=(r, args.workers, kind, args, port, out))
            for r in range(args.workers)
        ]
    else:
        import falcon

        cluster = falcon.local_cluster(workers=args.workers, policy="bsp", optimizer="local", lr=1)
        procs = [
            ctx.Process(target=falcon_worker, args=(r, args.workers, kind, args, dict(cluster.env), out))
            for r in range(args.workers)
        ]
    for p in procs:
        p.start()
    groups = []
    for r, p in enumerate(procs):
        cpus = args.quotas.get(r)
        if cpus is not None:
            import falcon

            q = falcon.CpuQuota(f"falcon-{os.getpid()}-bench-{side}-{r}", cpus)
            q.add(p.pid)
            groups.append(q)
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"{side} worker exited {p.exitcode}")
    for q in groups:
        q.close()
    if cluster is not None:
        cluster.finish()
    # The run's curve: each step's mean loss over the workers, at the slowest one's time.
    curve = [
        (max(g[5][s] for g in got), statistics.mean(g[4][s] for g in got))
        for s in range(len(got[0][4]))
    ]
    return statistics.mean(g[2] for g in got), [g[3] for g in got], curve


def smoothed(curve, k=5):
    return [(t, statistics.mean(l for _, l in curve[max(0, i - k + 1) : i + 1]))
            for i, (t, _) in enumerate(curve)]


def time_to(curve, target):
    return next((t for t, l in smoothed(curve) if l <= target), float("nan"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("cnn", "lm", "both"), default="both")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="the global batch")
    ap.add_argument("--sides", default="ddp,falcon", help="of ddp, falcon, plain")
    ap.add_argument("--cpu-quota", default="", help="RANKS:CPUS[,...]: workers held to CPU quotas")
    args = ap.parse_args(argv)
    args.quotas = {}
    if args.cpu_quota:
        import falcon

        # falcon's grammar, as FALCON_CPU_QUOTA and `falcon local --cpu-quota`.
        for r in range(args.workers):
            cpus = falcon._falcon.cpu_quota_of(args.cpu_quota, args.workers, r)
            if cpus is not None:
                args.quotas[r] = cpus
    sides = args.sides.split(",")
    if not set(sides) <= {"ddp", "falcon", "plain"} or not {"ddp", "falcon"} <= set(sides):
        raise SystemExit("--sides: ddp and falcon, and plain if wanted")
    kinds = ["cnn", "lm"] if args.model == "both" else [args.model]
    rows = []
    for kind in kinds:
        per = {s: [] for s in sides}
        losses = {s: [] for s in sides}
        curves = {s: [] for s in sides}
        for r in range(args.rounds):
            k = r % len(sides)
            for side in sides[k:] + sides[:k]:
                t, l, curve = run(side, kind, args)
                per[side].append(t)
                losses[side].append(l)
                curves[side].append(curve)
        target = max(smoothed(c)[-1][1] for s in ("ddp", "falcon") for c in curves[s])
        med = {s: statistics.median(per[s]) for s in sides}
        ttl = {s: statistics.median(time_to(c, target) for c in curves[s]) for s in sides}
        row = {
            "model": kind,
            "workers": args.workers,
            "ddp_step_ms": round(med["ddp"] * 1e3, 3),
            "falcon_step_ms": round(med["falcon"] * 1e3, 3),
            "ratio_falcon_over_ddp": round(med["falcon"] / med["ddp"], 3),
            "target_loss": round(target, 4),
            "ddp_time_to_loss_s": round(ttl["ddp"], 3),
            "falcon_time_to_loss_s": round(ttl["falcon"], 3),
            "ddp_final_losses": losses["ddp"][-1],
            "falcon_final_losses": losses["falcon"][-1],
        }
        if "plain" in sides:
            row["plain_step_ms"] = round(med["plain"] * 1e3, 3)
            row["ratio_falcon_over_plain"] = round(med["falcon"] / med["plain"], 3)
        rows.append(row)
    print(f"falcon beside DDP (gloo), {args.workers} worker processes, {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup}, global batch {args.batch}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}")
    print()
    plain = "plain" in sides
    print("| model | DDP step ms | falcon step ms | falcon / DDP |"
          + (" plain step ms | falcon / plain |" if plain else "")
          + " target loss | time to it, DDP s | falcon s | final loss DDP | final loss falcon |")
    print("|---|---:|---:|---:|" + ("---:|---:|" if plain else "") + "---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ddp_step_ms']} | {r['falcon_step_ms']} | "
              f"{r['ratio_falcon_over_ddp']} | "
              + (f"{r['plain_step_ms']} | {r['ratio_falcon_over_plain']} | " if plain else "")
              + f"{r['target_loss']} | {r['ddp_time_to_loss_s']} | {r['falcon_time_to_loss_s']} | "
              f"{', '.join(f'{v:.4f}' for v in r['ddp_final_losses'])} | "
              f"{', '.join(f'{v:.4f}' for v in r['falcon_final_losses'])} |")
    print("RESULT " + json.dumps({"rows": rows, "steps": args.steps, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
