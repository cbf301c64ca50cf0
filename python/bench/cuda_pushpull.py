"""Push + pull of a CUDA tensor through DLPack against the same on a host tensor and against
copying by hand (what a caller without the DLPack path does: `.cpu()` the gradient, push its
numpy view, pull into a host buffer, copy it back to the device).

One process, one worker: a local cluster (1 worker, 1 server, BSP, SGD) on threads of this
process. For each size, `--rounds` rounds after 5 warm-up rounds; each round does one push and
the pull after it three ways, in an order rotated every round; the figure of each way is the
median over rounds, and the ratio to the host way is the median of the rounds' ratios.

    python3 python/bench/cuda_pushpull.py [--rounds 50]

Needs a CUDA device. Prints a Markdown table and, last, one JSON line (`RESULT {...}`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np
import torch

import falcon

SIZES_KIB = [4, 64, 256, 1024, 4096, 16384]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_pushpull: no CUDA device (torch.cuda.is_available() is False)")
    tensors = {f"t{k}": k * 256 for k in SIZES_KIB}
    c = falcon.local_cluster(workers=1, policy="bsp", lr=0.001)
    w = falcon.init(tensors, env=c.env)
    rows = []
    for kib in SIZES_KIB:
        name, n = f"t{kib}", kib * 256
        g_dev = torch.randn(n, device="cuda")
        p_dev = torch.empty(n, device="cuda")
        g_host = g_dev.cpu().numpy()
        p_host = np.empty(n, np.float32)
        clock = [w.clock_of(name)]

        def host():
            w.push(name, g_host, clock[0])
            w.pull(name, p_host, clock[0] + 1)
            clock[0] += 1

        def device():
            w.push(name, g_dev, clock[0])
            w.pull(name, p_dev, clock[0] + 1)
            torch.cuda.current_stream().synchronize()
            clock[0] += 1

        def by_hand():
            w.push(name, g_dev.cpu().numpy(), clock[0])
            w.pull(name, p_host, clock[0] + 1)
            p_dev.copy_(torch.from_numpy(p_host))
            torch.cuda.current_stream().synchronize()
            clock[0] += 1

        ways = {"host": host, "device": device, "by hand": by_hand}
        times = {k: [] for k in ways}
        order = list(ways)
        for r in range(5 + args.rounds):
            order = order[1:] + order[:1]
            for k in order:
                t0 = time.perf_counter()
                ways[k]()
                if r >= 5:
                    times[k].append((time.perf_counter() - t0) * 1e6)
        ratio = lambda k: statistics.median(a / b for a, b in zip(times[k], times["host"]))
        rows.append(
            {
                "kib": kib,
                **{f"{k}_us": statistics.median(v) for k, v in times.items()},
                "device_over_host": ratio("device"),
                "by_hand_over_device": statistics.median(
                    a / b for a, b in zip(times["by hand"], times["device"])
                ),
            }
        )
    falcon.finish()
    c.finish()
    # What one DLPack export costs PyTorch (a push takes one, a pull one): the call with a
    # stream other than the current one, as falcon makes it (an event recorded and waited).
    side = torch.cuda.Stream()
    t = torch.randn(1024, device="cuda")
    export = []
    for i in range(1000):
        t0 = time.perf_counter()
        t.__dlpack__(stream=side.cuda_stream)
        if i >= 100:
            export.append((time.perf_counter() - t0) * 1e6)
    export_us = statistics.median(export)
    dev = torch.cuda.get_device_name(0)
    print(f"{datetime.date.today()}, {dev}, torch {torch.__version__}, {args.rounds} rounds")
    print("| size | host (µs) | CUDA tensor (µs) | by hand (µs) | CUDA / host | by hand / CUDA |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kib']} KiB | {r['host_us']:.1f} | {r['device_us']:.1f} | "
            f"{r['by hand_us']:.1f} | {r['device_over_host']:.2f} | {r['by_hand_over_device']:.2f} |"
        )
    print(f"one torch __dlpack__ export: {export_us:.1f} µs (median of 900)")
    print("RESULT " + json.dumps({"device": dev, "rows": rows, "export_us": export_us}))


if __name__ == "__main__":
    main()
