"""Horovod's own PyTorch tests, the cases that apply to a parameter server
(`horovod_cases.py`), run in two worker processes with default settings."""

from __future__ import annotations

import json

import falcon


def test_horovods_pytorch_cases_pass_with_default_settings(procs):
    import horovod_cases as hc

    workers = 2
    clusters = []
    envs = {}
    stores = []

    def job():
        # Each job's workers meet in a store of this test's own (as torchrun's agent hosts
        # one): no job's group waits on a port another job's role took.
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        stores.append(store)
        c = falcon.local_cluster(workers=workers, heartbeat_ms=200, rendezvous_timeout_ms=600_000)
        clusters.append(c)
        return {**c.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    for name in hc.CASES:
        envs[name] = [job() for _ in range(2 if name in hc.REINIT else 1)]
    for r in range(workers):
        procs.start(
            f"rank {r}", ["python/tests/horovod_cases.py", str(r), str(workers), json.dumps(envs)],
            {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(workers)},
        )
    outs = procs.wait_all(timeout=600)
    for c in clusters:
        c.finish()
    assert len(hc.CASES) >= 16
    for r in range(workers):
        lines = {l.split()[1]: l for l in outs[f"rank {r}"].splitlines() if l.startswith("HOROVOD ")}
        assert sorted(lines) == hc.CASES, f"rank {r} ran {sorted(lines)}"
        failed = [l for l in lines.values() if not l.endswith(" ok")]
        assert not failed, f"rank {r}:\n" + "\n".join(failed)
