"""falcon's mechanisms in a user's own training loop, on worker processes whose slowness the
kernel enforces: time for the global model to reach a target accuracy.

The examples' CNN (examples/torch_fashion_mnist.py's `Net`) on Fashion-MNIST (Debian's full
set where installed, else the bundled sample), or with `--model lm` the small causal
transformer LM of python/bench/ddp.py (here 2 blocks, d = 32, 2 heads, sequences of 16 over
64 tokens: Debian's torch multiplies matrices slowly) on a made-up language it must look back
to learn (each token the successor of the token two places before it, or a random token 30 %
of the time; scored by next-token accuracy on held-out sequences, at best about 0.7; 16
sequences per worker per iteration, rate 0.2, target 0.6), 4 worker processes of this host, each held to a
CPU quota in a control group of its own (`falcon.CpuQuota`; default `0-2:0.5,3:0.125`: worker 3
at a quarter of the others' share, 1.625 CPUs in all). Every configuration trains the same
model from the same values on the same examples — iteration c of worker w is the `--batch`
examples `falcon.torch.task_examples` names, `--tasks` tasks of them — with momentum SGD, in
the loop PyTorch's examples write:

- bsp, syncopt (`syncopt(1)`: one backup worker, the slowest gradient of a step dropped),
  asp: `DistributedOptimizer(SGD, model=model)` on a falcon job of that policy, the servers
  applying the optimizer; the loop indexes the examples itself;
- epsp: `epsp(0)` (a barrier per iteration, BSP's arithmetic), the loop iterating a
  `TaskLoader` passed to `DistributedOptimizer(..., tasks=loader, loss_fn=...)`: a worker the
  barrier holds back computes the straggler's unstarted tasks;
- ddp: `torch.nn.parallel.DistributedDataParallel` over gloo, the same loop;
- bsp-loader and epsp-no-transfer (not run by default): the `TaskLoader` loop under BSP, and
  under `epsp(0)` with `transfer=False`, which separate the loader's cost from the transfer's;
- syncopt-fold and syncopt-auto-fold (not run by default): `syncopt(1,fold)` and
  `syncopt(auto,fold)`, Sync-opt whose late gradients join the next step instead of being
  dropped, in the plain loop.

Worker 0 keeps a copy of its parameters (the global model it pulled; DDP's replica) every
`--every` iterations, with the time since its loop started; they are scored on the test set
after the run, so scoring never slows a job. Time to target: the first copy at or above
`--target`. Runs are interleaved (each seed runs every configuration, the order rotated).

    python3 python/bench/stragglers.py [--quick] [--model cnn|lm] [--seeds 1,2]
        [--iterations 300] [--target 0.75] [--lr 0.05] [--cpu-quota 0-2:0.5,3:0.125] [--configs bsp,epsp,syncopt,asp,ddp]

`--cpu-quota 0-3:0.5` (no straggler) measures what task transfer costs where nobody needs
it. Prints a Markdown table and, last, one JSON line: `RESULT {...}` with each
configuration's seconds to the target (median over seeds), training seconds and final
accuracy.
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
WORKERS = 4
POLICIES = {"bsp": "bsp", "epsp": "epsp(0)", "syncopt": "syncopt(1)", "asp": "asp",
            "epsp-no-transfer": "epsp(0)", "bsp-loader": "bsp",
            "syncopt-fold": "syncopt(1,fold)", "syncopt-auto-fold": "syncopt(auto,fold)"}
MOMENTUM = 0.9
LR = {"cnn": 0.05, "lm": 0.2}
BATCH = {"cnn": 32, "lm": 16}
TARGET = {"cnn": 0.75, "lm": 0.6}
QUICK_TARGET = {"cnn": 0.5, "lm": 0.2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def net(kind: str, seed: int) -> torch.nn.Module:
    """The model, from the seed's initial values: the examples' CNN, or ddp.py's LM."""
    if kind == "lm":
        lm = _module(ROOT / "python" / "bench" / "ddp.py", "falcon_bench_ddp").LM
        torch.manual_seed(seed)
        return lm(vocab=64, d=32, heads=2, blocks=2, seq=16)
    net = _module(ROOT / "examples" / "torch_fashion_mnist.py", "torch_fashion_mnist").Net
    torch.manual_seed(seed)
    return net()


def data(kind: str):
    """(train inputs, targets), (test inputs, targets), where they come from."""
    if kind == "lm":
        return token_streams()
    import falcon

    (tx, ty), (vx, vy), source = falcon.fashion_mnist(None)
    return (
        (torch.from_numpy(tx).unsqueeze(1), torch.from_numpy(ty).long()),
        (torch.from_numpy(vx).unsqueeze(1), torch.from_numpy(vy).long()),
        source,
    )


def token_streams(train=16384, test=1024, seq=16, vocab=64, noise=0.3, lag=2):
    """Sequences of a made-up language the LM can learn and be scored on: each token is the
    successor (a fixed permutation) of the token `lag` places before it or, with probability
    `noise`, a random one; the best possible next-token accuracy is about 1 − noise. With
    `lag` 2 the model must learn to look one token back (attention), not only at the token
    in hand. The same on every worker (a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    successor = torch.randperm(vocab, generator=g)
    n = train + test
    toks = torch.empty(n, seq + 1, dtype=torch.long)
    toks[:, :lag] = torch.randint(0, vocab, (n, lag), generator=g)
    flip = torch.rand(n, seq + 1, generator=g) < noise
    rand = torch.randint(0, vocab, (n, seq + 1), generator=g)
    for t in range(lag, seq + 1):
        toks[:, t] = torch.where(flip[:, t], rand[:, t], successor[toks[:, t - lag]])
    x, y = toks[:, :-1], toks[:, 1:]
    return (x[:train], y[:train]), (x[train:], y[train:]), f"a made-up language ({vocab} tokens)"


def loss_of(kind: str):
    if kind == "lm":
        return lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))
    return F.cross_entropy


def worker(cfg, rank, args, seed, env, port, out):
    """One worker process: the user's loop under configuration `cfg`."""
    torch.set_num_threads(1)
    import falcon.torch as ft

    (x, y), _, _ = data(args.model)
    model = net(args.model, seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    loss_fn = loss_of(args.model)
    loader = None
    if cfg == "ddp":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS
        )
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM)
    else:
        import falcon

        falcon.init(env={**env, "FALCON_ROLE": "worker", "FALCON_RANK": str(rank)})
        if cfg in ("epsp", "epsp-no-transfer", "bsp-loader"):
            loader = ft.TaskLoader(
                (x, y), args.batch, tasks=args.tasks, seed=seed, iterations=args.iterations,
                transfer=cfg == "epsp",
            )
            opt = ft.DistributedOptimizer(
                opt, model.named_parameters(), model=model, tasks=loader, loss_fn=loss_fn
            )
        else:
            opt = ft.DistributedOptimizer(opt, model.named_parameters(), model=model)

    def batches():
        if loader is not None:
            yield from loader
            return
        for c in range(args.iterations):
            idx = torch.cat([
                ft.task_examples(len(x), WORKERS, args.batch, args.tasks, seed, rank, c, t)
                for t in range(args.tasks)
            ])
            yield x[idx], y[idx]

    snaps, loss = [], None
    start = time.perf_counter()
    for c, (xb, yb) in enumerate(batches()):
        if rank == 0 and c % args.every == 0:
            if cfg != "ddp" and loader is None:
                opt.wait_pulls()
            snaps.append((time.perf_counter() - start, c, _flat(model)))
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
    if cfg != "ddp":
        opt.wait_pulls()
    secs = time.perf_counter() - start
    if rank == 0:
        snaps.append((secs, args.iterations, _flat(model)))
    stats = dict(loader.stats) if loader is not None else {}
    out.put((rank, secs, snaps, float(loss) if loss is not None else None, stats))
    if cfg == "ddp":
        torch.distributed.destroy_process_group()
    else:
        import falcon

        falcon.finish()


def _flat(model):
    # A numpy copy: a tensor sent through a queue is shared memory its sender frees on exit.
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def run(cfg, args, seed, quotas):
    """One job: worker 0's copies (time, iteration, values), each worker's seconds, stats."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cluster, port, env = None, None, {}
    if cfg == "ddp":
        port = free_port()
    else:
        import falcon

        # Exact mode (falcon's default): the servers only average, each worker's own SGD
        # applies the step's mean, as DDP's; servers' mode: the servers apply momentum SGD.
        servers = {} if args.mode == "exact" else {"optimizer": f"momentum({MOMENTUM})", "lr": args.lr}
        cluster = falcon.local_cluster(
            workers=WORKERS, policy=POLICIES[cfg], heartbeat_ms=200, **servers
        )
        env = dict(cluster.env)
    procs = [
        ctx.Process(target=worker, args=(cfg, r, args, seed, env, port, out))
        for r in range(WORKERS)
    ]
    for p in procs:
        p.start()
    groups = []
    if quotas:
        import falcon

        for r, p in enumerate(procs):
            if r in quotas:
                q = falcon.CpuQuota(f"falcon-{os.getpid()}-stragglers-{cfg}-{r}", quotas[r])
                q.add(p.pid)
                groups.append(q)
    got = sorted((out.get(timeout=1800) for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join(120)
        if p.exitcode != 0:
            raise SystemExit(f"{cfg} worker exited {p.exitcode}")
    for q in groups:
        q.close()
    report = cluster.finish() if cluster is not None else {}
    return {
        "snaps": got[0][2],
        "secs": max(g[1] for g in got),
        "last_loss": statistics.mean(g[3] for g in got if g[3] is not None),
        "stats": [g[4] for g in got],
        "transferred": report.get("scheduler", {}).get("tasks_transferred", 0),
    }


def accuracy(model, values, test) -> float:
    """The share of test examples (of the LM: of next tokens) the values predict right."""
    x, y = test
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(values), model.parameters())
        model.eval()
        return float((model(x).argmax(-1) == y).float().mean())


def parse_quotas(text: str) -> dict[int, float]:
    """Each worker's CPUs in `RANKS:CPUS[,...]` (falcon's grammar, as FALCON_CPU_QUOTA)."""
    import falcon

    cpus = {r: falcon._falcon.cpu_quota_of(text, WORKERS, r) for r in range(WORKERS)}
    return {r: c for r, c in cpus.items() if c is not None}


def quotas_usable(quotas) -> str | None:
    """None when control groups can be made here; else why not."""
    if not quotas:
        return None
    import falcon

    try:
        falcon.CpuQuota(f"falcon-{os.getpid()}-stragglers-probe", 1.0).close()
    except Exception as e:  # noqa: BLE001 (any refusal: no controller, not writable)
        return str(e)
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one seed, 40 iterations, target 0.5 (LM 0.2): a check that everything runs")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--batch", type=int, default=None,
                    help="examples per worker per iteration (default: CNN 32, LM 16)")
    ap.add_argument("--tasks", type=int, default=4, help="tasks per iteration")
    ap.add_argument("--every", type=int, default=10, help="iterations between worker 0's copies")
    ap.add_argument("--model", choices=("cnn", "lm"), default="cnn",
                    help="the examples' CNN on Fashion-MNIST, or a small transformer LM on a "
                         "made-up language (next-token accuracy)")
    ap.add_argument("--target", type=float, default=None,
                    help="test accuracy to reach (default: CNN 0.75, LM 0.6)")
    ap.add_argument("--lr", type=float, default=None, help="default: CNN 0.05, LM 0.2")
    ap.add_argument("--cpu-quota", default="0-2:0.5,3:0.125",
                    help="RANKS:CPUS[,...] (empty: no quotas)")
    ap.add_argument("--configs", default="bsp,epsp,syncopt,asp,ddp")
    ap.add_argument("--test-examples", type=int, default=2000)
    ap.add_argument("--mode", choices=("exact", "servers"), default="exact",
                    help="exact (falcon's default): each worker applies its own optimizer to the "
                         "step's mean gradient, as DDP; servers: the servers apply momentum SGD")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations, args.every = "1", 40, 5
        args.target = QUICK_TARGET[args.model] if args.target is None else args.target
    args.target = TARGET[args.model] if args.target is None else args.target
    args.lr = LR[args.model] if args.lr is None else args.lr
    args.batch = BATCH[args.model] if args.batch is None else args.batch
    configs = args.configs.split(",")
    unknown = set(configs) - set(POLICIES) - {"ddp"}
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; of {', '.join(POLICIES)}, ddp")
    seeds = [int(s) for s in args.seeds.split(",")]
    quotas = parse_quotas(args.cpu_quota)
    why = quotas_usable(quotas)
    if why is not None:
        print(f"SKIPPED: CPU quotas ({why}): every worker runs at full speed")
        quotas = {}
    _, (vx, vy), source = data(args.model)
    test = (vx[: args.test_examples], vy[: args.test_examples])
    scorer = net(args.model, 0)
    rows = {c: {"to_target": [], "secs": [], "final": [], "moved": []} for c in configs}
    for i, seed in enumerate(seeds):
        k = i % len(configs)
        for cfg in configs[k:] + configs[:k]:
            r = run(cfg, args, seed, quotas)
            curve = [(t, c, accuracy(scorer, v, test)) for t, c, v in r["snaps"]]
            hit = next((t for t, _, a in curve if a >= args.target), float("nan"))
            rows[cfg]["to_target"].append(hit)
            rows[cfg]["secs"].append(r["secs"])
            rows[cfg]["final"].append(curve[-1][2])
            rows[cfg]["moved"].append(r["transferred"])
            print(f"# seed {seed} {cfg}: {r['secs']:.1f} s, target at {hit:.1f} s, final "
                  f"accuracy {curve[-1][2]:.4f}, tasks moved {r['transferred']}", flush=True)

    def med(v):
        v = [x for x in v if x == x]
        return round(statistics.median(v), 2) if v else None

    result = {c: {"seconds_to_target": med(rows[c]["to_target"]),
                  "reached": sum(1 for t in rows[c]["to_target"] if t == t),
                  "training_seconds": med(rows[c]["secs"]),
                  "final_accuracy": round(statistics.mean(rows[c]["final"]), 4),
                  "tasks_moved": round(statistics.mean(rows[c]["moved"]), 1)} for c in configs}
    model = "the examples' CNN" if args.model == "cnn" else "the transformer LM"
    print(f"\nfalcon in the user's loop, {model}, {WORKERS} worker processes, CPU quotas "
          f"{args.cpu_quota or 'none'}, {args.iterations} iterations × {args.batch} examples "
          f"({args.tasks} tasks) per worker, {args.mode} mode, target accuracy {args.target} on {len(test[0])} "
          f"test examples ({source}), lr {args.lr}, seeds {args.seeds}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}")
    print()
    base = result.get("bsp", {}).get("seconds_to_target")
    print("| configuration | s to target | / BSP | runs reaching it | training s | "
          "final accuracy | tasks moved |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in configs:
        r = result[c]
        ratio = (round(r["seconds_to_target"] / base, 3)
                 if base and r["seconds_to_target"] is not None else None)
        r["over_bsp"] = ratio
        print(f"| {c} | {r['seconds_to_target']} | {ratio} | {r['reached']}/{len(seeds)} | "
              f"{r['training_seconds']} | {r['final_accuracy']} | {r['tasks_moved']} |")
    print("RESULT " + json.dumps({"configs": result, "quotas": args.cpu_quota, "mode": args.mode,
                                  "model": args.model, "lr": args.lr,
                                  "iterations": args.iterations, "target": args.target,
                                  "seeds": seeds}))


if __name__ == "__main__":
    main()
