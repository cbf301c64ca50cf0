"""Time to a target accuracy under EPSP, BSP, SSP(3) and ASP, with one slow worker.

examples/torch_fashion_mnist.py's CNN on Fashion-MNIST, trained by `falcon.torch.fit` (the
task-driven trainer) on 4 workers, each a separate process, worker 3 at a quarter of the
speed (FALCON_HETERO=3:h=0.25, applied by `fit`). The scheduler and the server run on threads
of this process (`falcon.local_cluster`). Everything but the policy is the same: the model
and its initial values, the data order, the learning rate, the iterations, the batch, the
tasks per iteration, task transfer on. Worker 0 keeps a snapshot of its values every
`--snapshot-every` iterations; after training it scores each on the test set
(`falcon.torch.evaluate`), so that scoring never slows the job. Time to target: the time
(since worker 0 started training) of the first snapshot at or above the target.

The policies run one after another, `--repeats` times, the order rotated each repeat; the
table gives medians over the repeats, then every run.

    target/pyenv/bin/python python/bench/policies.py [--repeats 3] [--target 0.75]

Prints Markdown, then one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("epsp", "bsp", "ssp(3)", "asp")
WORKERS = 4


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated (default: epsp,bsp,ssp(3),asp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.75, help="test accuracy to reach")
    ap.add_argument("--iterations", type=int, default=500, help="per worker")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.2, help="FALCON_LR (SGD)")
    ap.add_argument("--hetero", default="3:h=0.25", help="FALCON_HETERO")
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", default=None, help="Fashion-MNIST directory (default: "
                    "falcon.fashion_mnist()'s choice)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    # Internal: a worker process of one run.
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# --- a worker process ------------------------------------------------------------------------


def worker(args) -> None:
    import importlib.util

    import torch
    import torch.nn.functional as F

    import falcon
    import falcon.torch as ft

    spec = importlib.util.spec_from_file_location(
        "torch_fashion_mnist", ROOT / "examples" / "torch_fashion_mnist.py"
    )
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    torch.set_num_threads(1)
    (tx, ty), (vx, vy), source = falcon.fashion_mnist(args.data)
    x, y = torch.from_numpy(tx).unsqueeze(1), torch.from_numpy(ty).long()
    test = (torch.from_numpy(vx).unsqueeze(1), torch.from_numpy(vy).long())
    torch.manual_seed(args.seed)
    model = ex.Net()
    falcon.init()
    s = ft.fit(
        model, F.cross_entropy, (x, y), iterations=args.iterations, batch=args.batch,
        tasks=args.tasks, seed=args.seed, transfer=True, threads=1,
        snapshot_every=args.snapshot_every,
    )
    falcon.finish()
    out = {k: s[k] for k in ("rank", "iterations", "secs", "compute_s", "blocked_s",
                             "helping_s", "injected_s", "tasks_own", "tasks_helped",
                             "tasks_given")}
    out["source"] = source
    # Scored after training: (secs, iteration, accuracy) of each snapshot.
    out["curve"] = [(t, it, ft.evaluate(model, v, test)) for t, it, v in s["snapshots"]]
    Path(args.worker_out).write_text(json.dumps(out))


# --- the driver ------------------------------------------------------------------------------


def run_policy(args, policy: str, tmp: Path) -> dict:
    import falcon

    cluster = falcon.local_cluster(workers=WORKERS, servers=1, policy=policy, lr=args.lr)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("FALCON_", "DMLC_")) and k not in ("RANK", "WORLD_SIZE")}
    base.update(cluster.env)
    base.update(FALCON_HETERO=args.hetero, OMP_NUM_THREADS="1")
    procs, outs = [], []
    t0 = time.perf_counter()
    for r in range(WORKERS):
        out = tmp / f"{policy}-{r}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker-out", str(out),
               "--iterations", str(args.iterations), "--batch", str(args.batch),
               "--tasks", str(args.tasks), "--snapshot-every", str(args.snapshot_every),
               "--seed", str(args.seed)] + (["--data", args.data] if args.data else [])
        procs.append(subprocess.Popen(cmd, env=dict(base, FALCON_RANK=str(r))))
        outs.append(out)
    deadline = t0 + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.perf_counter()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise SystemExit(f"{policy}: worker(s) {bad} failed")
    cluster.finish(timeout=60)
    ws = [json.loads(o.read_text()) for o in outs]
    curve = ws[0]["curve"]
    hit = next(((t, it) for t, it, a in curve if a >= args.target), None)
    job_secs = max(w["secs"] for w in ws)
    return {
        "policy": policy,
        "time_to_target": None if hit is None else hit[0],
        "iteration_at_target": None if hit is None else hit[1],
        "final_accuracy": curve[-1][2] if curve else None,
        "best_accuracy": max((a for _, _, a in curve), default=None),
        "job_secs": job_secs,
        "worker0_secs": ws[0]["secs"],
        # Iterations of the whole job (every worker's, the straggler's included) per second
        # of the job's training time.
        "iterations_per_s": sum(w["iterations"] for w in ws) / job_secs,
        "tasks_helped": sum(w["tasks_helped"] for w in ws),
        "tasks_of_straggler_taken": ws[-1]["tasks_given"],
        "blocked_s_worker0": ws[0]["blocked_s"],
        "wall_s": wall,
        "source": ws[0]["source"],
        "curve": curve,
    }


def fmt(v, spec=".1f", none="not reached"):
    return none if v is None else format(v, spec)


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker_out:
        worker(args)
        return
    import torch

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="falcon-policies-") as d:
        for rep in range(args.repeats):
            order = policies[rep % len(policies):] + policies[: rep % len(policies)]
            for p in order:
                r = run_policy(args, p, Path(d))
                r["repeat"] = rep
                runs.append(r)
                print(f"repeat {rep}: {p}: to target {fmt(r['time_to_target'])} s, final "
                      f"{r['final_accuracy']:.3f}, {r['iterations_per_s']:.1f} it/s",
                      file=sys.stderr, flush=True)

    import falcon

    so = Path(falcon._falcon.__file__)
    cmd = "target/pyenv/bin/python " + " ".join(
        [os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    print(f"## Time to {args.target:.0%} test accuracy by policy, {datetime.date.today().isoformat()}\n")
    print(f"`{cmd}`\n")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch.__version__}; extension {so.name} "
          f"{so.stat().st_size / 2**20:.1f} MiB")
    print(f"- job: {WORKERS} worker processes + 1 server and the scheduler (threads of the "
          f"driver), FALCON_HETERO={args.hetero}, SGD FALCON_LR={args.lr}, `fit` with "
          f"{args.iterations} iterations × {args.batch} examples per worker, {args.tasks} tasks, "
          f"task transfer on, 1 torch thread to start; data: {runs[0]['source']}")
    print(f"- worker 0 snapshots every {args.snapshot_every} iterations, scored after training; "
          f"medians over {args.repeats} repeat(s) (order rotated)\n")
    print("| policy | time to target (s) | final accuracy | iterations/s (job) | tasks taken over |")
    print("|---|---:|---:|---:|---:|")
    for p in policies:
        rs = [r for r in runs if r["policy"] == p]
        tt = [r["time_to_target"] for r in rs]
        reached = [t for t in tt if t is not None]
        t_med = statistics.median(reached) if len(reached) == len(tt) else None
        tt_text = fmt(t_med) if t_med is not None else (
            f"not reached in {len(tt) - len(reached)} of {len(tt)}")
        print(f"| {p} | {tt_text} | {statistics.median(r['final_accuracy'] for r in rs):.3f} | "
              f"{statistics.median(r['iterations_per_s'] for r in rs):.1f} | "
              f"{statistics.median(r['tasks_helped'] for r in rs):.0f} |")
    print("\nEvery run:\n")
    print("| repeat | policy | time to target (s) | at iteration | final acc. | best acc. | "
          "training (s) | iterations/s | worker 0 blocked (s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['repeat']} | {r['policy']} | {fmt(r['time_to_target'])} | "
              f"{fmt(r['iteration_at_target'], 'd', '—')} | {r['final_accuracy']:.3f} | "
              f"{r['best_accuracy']:.3f} | {r['job_secs']:.1f} | {r['iterations_per_s']:.1f} | "
              f"{r['blocked_s_worker0']:.1f} |")
    print("RESULT " + json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in runs]))


if __name__ == "__main__":
    main()
