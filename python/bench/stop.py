"""How long a job trains on after one of its ranks stops: falcon beside DDP (gloo).

Three worker processes of one host, started as a launcher starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; no torchrun, whose agent tears ranks down on its own 5 s
monitoring period), train a tiny model step after step. After 5 steps rank 2 stops itself —
Ctrl-C (`int`), SIGTERM (`term`) or an exception its script raises (`raise`) — and prints the
time. The figure of a run is how long after that the last rank's process ended (the others
must notice and stop); a rank still running at `--limit` seconds is killed and the run
counted as `> limit`.

- falcon: `falcon.torch.DistributedOptimizer`, each worker's own SGD (the default), BSP; rank 0
  hosts the scheduler and the server. A stopping rank tells the job (`Worker.abort`).
- DDP: `DistributedDataParallel` over gloo (`init_process_group("gloo")`, env://, a
  `--limit` timeout), the same model and loop.

Rounds alternate the sides; each figure is the median over rounds (min–max beside it).

    python3 python/bench/stop.py [--rounds 3] [--causes int,term,raise] [--limit 30]

Prints a Markdown table and, last, one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

RANKS = 3


def worker(side: str, how: str, limit: float) -> None:
    """One rank: trains until rank 2 stops itself after 5 steps."""
    import torch

    rank = int(os.environ["RANK"])
    model = torch.nn.Linear(4, 2)
    if side == "falcon":
        import falcon
        import falcon.torch as ft

        falcon.init()
        opt = ft.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      model.named_parameters())
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=limit))
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    for step in range(10**9):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if rank == RANKS - 1 and step == 5:
            print(f"STOPPING {time.time()}", flush=True)
            if how == "int":
                os.kill(os.getpid(), signal.SIGINT)
            elif how == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise ValueError("the user's own bug")
        time.sleep(0.01)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(side: str, how: str, limit: float) -> float:
    """Seconds from rank 2's stop to the last rank's exit (inf: past `limit`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FALCON_", "DMLC_"))}
    env.update(WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
               OMP_NUM_THREADS="1", FALCON_POLICY="bsp")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", side, how, str(limit)],
                         env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        for r in range(RANKS)
    ]
    ended = [None] * RANKS
    deadline = time.time() + limit + 60
    while None in ended and time.time() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.01)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = procs[RANKS - 1].communicate()[0]
    for p in procs[:-1]:
        p.communicate()
    stops = [line for line in out.splitlines() if line.startswith("STOPPING ")]
    if not stops:
        raise SystemExit(f"{side} {how}: rank {RANKS - 1} never reached its stop")
    stop = float(stops[0].split()[1])
    if None in ended:
        return float("inf")
    return max(ended) - stop


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causes", default="int,term,raise")
    ap.add_argument("--limit", type=float, default=30.0)
    a = ap.parse_args()
    causes = a.causes.split(",")
    sides = ["falcon", "ddp"]
    got: dict = {(s, c): [] for s in sides for c in causes}
    for r in range(a.rounds):
        for c in causes:
            for s in sides if r % 2 == 0 else sides[::-1]:
                got[(s, c)].append(one_run(s, c, a.limit))

    def cell(v):
        med = statistics.median(v)
        show = (lambda x: f"> {a.limit:.0f}" if x == float("inf") else f"{x:.2f}")
        return f"{show(med)} ({show(min(v))}–{show(max(v))})"

    print(f"| cause | falcon: s until every rank ended | DDP (gloo) | falcon / DDP |")
    print("| --- | --- | --- | --- |")
    result = {}
    for c in causes:
        f, d = statistics.median(got[("falcon", c)]), statistics.median(got[("ddp", c)])
        ratio = f / d if d not in (0, float("inf")) else 0.0
        print(f"| {c} | {cell(got[('falcon', c)])} | {cell(got[('ddp', c)])} | "
              f"{ratio:.2f} |")
        result[c] = {"falcon": got[("falcon", c)], "ddp": got[("ddp", c)]}
    print("RESULT " + json.dumps({"date": datetime.date.today().isoformat(), "rounds": a.rounds,
                                  "limit": a.limit, "runs": result},
                                 default=lambda x: None))


if __name__ == "__main__":
    main()
