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
