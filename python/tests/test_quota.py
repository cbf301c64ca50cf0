"""CPU quotas the kernel enforces, from Python (`falcon.CpuQuota`): a control group holding a
real process. Where cgroups are not writable here, the test skips visibly (pytest -rs)."""

from __future__ import annotations

import os
import subprocess

import pytest

import falcon


def test_a_cpu_quota_is_checked_holds_a_process_and_is_removed():
    with pytest.raises(falcon.ConfigError, match="CPUs > 0"):
        falcon.CpuQuota("x", 0)
    with pytest.raises(falcon.ConfigError, match="letters, digits"):
        falcon.CpuQuota("../escape", 1)
    try:
        q = falcon.CpuQuota(f"falcon-{os.getpid()}-pytest", 0.1)
    except falcon.Error as e:
        pytest.skip(f"no CPU quota can be made here: {e}")
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        q.add(busy.pid)
        with open(os.path.join(q.path, "cgroup.procs")) as f:
            assert str(busy.pid) in f.read().split()
        assert q.cpus == pytest.approx(0.1)
    finally:
        busy.kill()
        busy.wait()
    path = q.path
    q.close()
    assert not os.path.exists(path)
    assert q.path is None
    with pytest.raises(falcon.ConfigError, match="closed"):
        q.add(busy.pid)


QUOTA_WORKER = """
import os, falcon
falcon.init({"w": 4})
q = falcon._quota
path = q.path if q is not None else None
print("GROUP", path, flush=True)
import falcon.torch as ft
print("CPUS", ft._usable_cpus(), flush=True)  # what a thread-count advice is capped at
with open("/proc/self/cgroup") as f:
    print("IN", any(path is not None and os.path.basename(path) in l for l in f), flush=True)
falcon.finish()
with open("/proc/self/cgroup") as f:
    print("AFTER", any(path is not None and os.path.basename(path) in l for l in f), flush=True)
"""


def test_falcon_cpu_quota_holds_a_worker_process_from_init_to_finish():
    pytest.importorskip("torch")
    try:
        falcon.CpuQuota(f"falcon-{os.getpid()}-probe", 1).close()
    except falcon.Error as e:
        pytest.skip(f"no CPU quota can be made here: {e}")
    import sys

    c = falcon.local_cluster(workers=2, policy="bsp", lr=0.1)
    env = {**os.environ, **c.env, "FALCON_ROLE": "worker", "FALCON_CPU_QUOTA": "1:0.5"}
    procs = [
        subprocess.Popen([sys.executable, "-c", QUOTA_WORKER], env={**env, "FALCON_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    c.finish()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    lines = [dict(l.split(" ", 1) for l in out.splitlines()) for out, _ in outs]
    assert {k: lines[0][k] for k in ("GROUP", "IN", "AFTER")} == {
        "GROUP": "None", "IN": "False", "AFTER": "False"
    }, outs[0]
    assert lines[1]["CPUS"] == "1", "half a CPU: one thread"
    group = lines[1]["GROUP"]
    assert group != "None" and lines[1]["IN"] == "True", outs[1]
    assert lines[1]["AFTER"] == "False", "the worker left its group at finish()"
    assert not os.path.exists(group), "the group is removed"
    with pytest.raises(falcon.ConfigError, match="RANKS:CPUS"):
        falcon._falcon.cpu_quota_of("3=0.5", 4, 3)


def test_a_stale_group_is_reused_and_close_removes_a_group_still_holding_a_process():
    """A run killed before removing its group leaves it behind: the next quota of that name
    reuses it (no "File exists"); close() ends the quota even for a process still in it."""
    name = f"falcon-{os.getpid()}-stale"
    try:
        q = falcon.CpuQuota(name, 0.5)
    except falcon.Error as e:
        pytest.skip(f"no CPU quota can be made here: {e}")
    path = q.path
    busy = subprocess.Popen(["sh", "-c", "sleep 30"])
    try:
        q.add(busy.pid)
        with pytest.raises(falcon.ConfigError, match="in use"):
            falcon.CpuQuota(name, 0.25)
        q.close()  # the process is still in it
        assert not os.path.exists(path)
    finally:
        busy.kill()
        busy.wait()
    os.mkdir(path)  # what a killed run leaves
    try:
        again = falcon.CpuQuota(name, 0.25)
        assert again.path == path and again.cpus == pytest.approx(0.25)
        again.close()
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.rmdir(path)
