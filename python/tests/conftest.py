"""Shared helpers of the Python package's tests: processes of a job, free ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# Variables that would decide a role or a job in a child: the test's own environment never does.
LAUNCH = {
    "FALCON_ROLE", "FALCON_RANK", "FALCON_SCHEDULER", "FALCON_NUM_WORKER",
    "FALCON_NUM_SERVER", "DMLC_ROLE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "FALCON_HETERO", "FALCON_POLICY",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    env.update({k: str(v) for k, v in extra.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Procs:
    """Processes of one job, killed at the end of the test whatever happens."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, *args], env=child_env(env), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        self.procs.append((name, p))
        return p

    def serve(self, role: str, env: dict[str, str]) -> subprocess.Popen:
        """A scheduler or server run by `falcon.init()` in a process of its own."""
        return self.start(role, ["-c", "import falcon; falcon.init()"], {**env, "FALCON_ROLE": role})

    def wait_all(self, timeout: float = 120) -> dict[str, str]:
        """Every process's stdout by name; fails on a nonzero exit or a timeout."""
        outs = {}
        for name, p in self.procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                pytest.fail(f"{name} did not end within {timeout} s:\n{out}\n{err}")
            assert p.returncode == 0, f"{name} exited {p.returncode}:\n{out}\n{err}"
            outs[name] = out
        return outs

    def kill(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill()


def fit_lines(out: str) -> dict:
    """The `FIT {json}` line of a fit worker's output."""
    for line in out.splitlines():
        if line.startswith("FIT "):
            return json.loads(line[4:])
    raise AssertionError(f"no FIT line in:\n{out}")


@pytest.fixture
def bsp1():
    """A one-worker BSP job on threads of this process, joined as `w` (4 floats)."""
    import falcon

    c = falcon.local_cluster(workers=1, policy="bsp", lr=0.5)
    w = falcon.init({"w": 4}, env=c.env)
    yield w
    falcon.finish()
    c.finish()
