"""examples/torch_fashion_mnist.py, run as examples/README.md documents it: one host, 4 workers
(worker 3 at a quarter of the speed), EPSP, the task-driven trainer, on the Fashion-MNIST
sample bundled with falcon's sources; and the DistributedOptimizer mode under the launcher
loop that sets torchrun's variables by hand.

Run from the repository root with the virtualenv's python, after the package is installed:

    target/pyenv/bin/python -m pytest python/tests/test_example.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch_fashion_mnist.py"
SAMPLE = ROOT / "data" / "fashion-mnist-sample"

# The documented launch: 4 ranks, 4 workers (rank 0 hosting the scheduler and the server),
# worker 3 at h = 0.25, EPSP.
JOB = {
    "FALCON_POLICY": "epsp",
    "FALCON_HETERO": "3:h=0.25",
    "FALCON_LR": "0.2",
}
# The example's default run (500 iterations of 64 examples per worker) reached 0.74-0.83 on
# the sample's 1000 test images in 23 runs on a 2-core VM (0.80 typical); the final values
# of an asynchronous job at a constant rate are noisy, so 0.70 leaves a margin.
FIT_ACCURACY = 0.70
# The optimizer mode, 200 iterations: a smoke test of the other way in (0.63-0.77 seen).
OPTIMIZER_ACCURACY = 0.50
# Per run: the example takes 10-25 s here; the limit only keeps a hung job from hanging the
# suite.
TIMEOUT_S = 150


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """Runs `cmd` in its own process group from the repository root; kills the whole group
    (the launcher and every rank) if it outlives `timeout`. Returns stdout and stderr."""
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{out[-4000:]}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out[-4000:]}"
    return out


def _result(out: str) -> tuple[float, dict]:
    """The ACCURACY line and the SUMMARY line of worker 0 (torchrun's --tee prefixes lines
    with [defaultN]:)."""
    accs = re.findall(r"^(?:\[\w+\]:)?ACCURACY (\d+(?:\.\d+)?)\s*$", out, re.M)
    sums = re.findall(r"^(?:\[\w+\]:)?SUMMARY (\{.*\})\s*$", out, re.M)
    assert len(accs) == 1 and len(sums) == 1, f"expected one ACCURACY and one SUMMARY:\n{out[-4000:]}"
    return float(accs[0]), json.loads(sums[0])


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FALCON_", "DMLC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(JOB)
    env.update(extra)
    env["TMPDIR"] = str(tmp_path)  # torchrun's per-rank logs (--redirects) go here
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_works() -> bool:
    try:
        import torch.distributed as dist
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


def test_fit_epsp_with_a_straggler_reaches_the_stated_accuracy(tmp_path):
    # As documented: torchrun with its default (static) rendezvous, whose agent holds
    # MASTER_PORT (falcon's scheduler takes the next port), 4 ranks, the same script on
    # each; --redirects 1 --tee 1: Debian's torch 1.13 under Python 3.11 fails on the
    # defaults. A free --master_port, so that concurrent runs do not meet.
    if _torchrun_works():
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--master_port", str(_free_port()),
            "--redirects", "1", "--tee", "1", "--nproc_per_node", "4", str(EXAMPLE),
            "--data", str(SAMPLE),
        ]
        out = _run(cmd, _env(tmp_path), TIMEOUT_S)
    else:  # a torch without torch.distributed: the documented launcher loop
        out = _launcher_loop(tmp_path, ["--data", str(SAMPLE)])
    acc, s = _result(out)
    assert s["mode"] == "fit" and s["policy"].startswith("epsp"), s
    assert s["workers"] == 4 and s["hetero"] == "3:h=0.25" and s["iterations"] == 500, s
    assert s["train_examples"] == 5000 and s["test_examples"] == 1000, s  # the sample
    assert s["tasks_helped"] > 0, f"worker 0 never took over a straggler's tasks: {s}"
    assert acc == s["accuracy"]
    print(f"fit, EPSP, worker 3 at h=0.25: accuracy {acc:.4f} in {s['secs']:.1f} s, "
          f"{s['tasks_helped']} tasks taken over by worker 0")
    assert acc >= FIT_ACCURACY, f"test accuracy {acc} < {FIT_ACCURACY}: {s}"


def _launcher_loop(tmp_path: Path, args: list[str]) -> str:
    """The launcher loop of examples/README.md: four processes with RANK/WORLD_SIZE/MASTER_*,
    in one process group (a shell), so that a timeout kills them all."""
    port = _free_port()
    env = _env(tmp_path, WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    quoted = " ".join(f"'{a}'" for a in [sys.executable, str(EXAMPLE), *args])
    script = (
        f"pids=; for r in 0 1 2 3; do RANK=$r {quoted} & pids=\"$pids $!\"; done; "
        "rc=0; for p in $pids; do wait $p || rc=$?; done; exit $rc"
    )
    return _run(["bash", "-c", script], env, TIMEOUT_S)


def test_distributed_optimizer_mode_under_the_launcher_loop(tmp_path):
    out = _launcher_loop(
        tmp_path, ["--mode", "optimizer", "--iterations", "200", "--data", str(SAMPLE)]
    )
    assert "Traceback" not in out, out[-4000:]
    acc, s = _result(out)
    assert s["mode"] == "optimizer" and s["policy"].startswith("epsp"), s
    assert s["workers"] == 4 and s["iterations"] == 200 and s["optimizer"] == "sgd", s
    print(f"DistributedOptimizer, EPSP, worker 3 at h=0.25: accuracy {acc:.4f} in "
          f"{s['secs']:.1f} s")
    assert acc >= OPTIMIZER_ACCURACY, f"test accuracy {acc} < {OPTIMIZER_ACCURACY}: {s}"


def test_the_pytorch_quick_start_runs_as_written(tmp_path):
    # The README's and the script's own launch line: AdamW, a schedule and clipping with
    # each worker's own optimizer; both workers end with the same model.
    if not _torchrun_works():
        pytest.skip("this torch has no torch.distributed: torchrun is not available")
    env = {**_env(tmp_path), "FALCON_POLICY": "bsp"}  # no optimizer named: the default, exact
    for k in ("FALCON_HETERO", "FALCON_LR"):
        env.pop(k, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--master_port", str(_free_port()),
        "--nproc_per_node", "4", "--redirects", "1", "--tee", "1",
        str(ROOT / "examples" / "torch_quickstart.py"),
    ]
    out = _run(cmd, env, TIMEOUT_S)
    done = re.findall(r"DONE ([0-9.]+)", out)
    # 4 ranks, 4 workers, each with its rank; every replica the same.
    assert len(done) == 4 and len(set(done)) == 1, out[-3000:]
    assert sorted(set(re.findall(r"worker (\d) step", out))) == ["0", "1", "2", "3"], out[-3000:]
    assert float(done[0]) < 1.2, out[-3000:]
    assert "job done" in out, out[-3000:]


def test_the_straggler_benchmark_runs_every_side_in_quick_mode():
    """python/bench/stragglers.py --quick, two of its configurations (task transfer in the
    user's loop, and DDP): it ends with a RESULT line naming each, every run finished."""
    out = subprocess.run(
        [sys.executable, "python/bench/stragglers.py", "--quick", "--configs", "epsp,ddp",
         "--test-examples", "500"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout
    result = json.loads(last[len("RESULT "):])
    assert set(result["configs"]) == {"epsp", "ddp"}
    for name, r in result["configs"].items():
        assert r["training_seconds"] > 0 and 0 <= r["final_accuracy"] <= 1, (name, r)
    if "SKIPPED" not in out.stdout:
        # Worker 3 at a quarter of the others' CPU: the others take its tasks.
        assert result["configs"]["epsp"]["tasks_moved"] > 0, out.stdout


def test_the_straggler_benchmark_runs_the_transformer_lm_quickly():
    """python/bench/stragglers.py --quick --model lm: the transformer LM on its made-up
    language, task transfer in the user's loop; the RESULT names the model, and the other
    workers take the slowed worker's tasks."""
    out = subprocess.run(
        [sys.executable, "python/bench/stragglers.py", "--quick", "--model", "lm",
         "--configs", "epsp", "--test-examples", "256"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout
    result = json.loads(last[len("RESULT "):])
    assert result["model"] == "lm" and set(result["configs"]) == {"epsp"}
    r = result["configs"]["epsp"]
    assert r["training_seconds"] > 0 and 0 <= r["final_accuracy"] <= 1, r
    if "SKIPPED" not in out.stdout:
        assert r["tasks_moved"] > 0, out.stdout


def _tutorial(tmp_path: Path, ranks: int, *extra: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the torchrun line of python/tests/ddp_tutorial.py on `ranks`
    ranks under BSP (skips where torch has no torch.distributed)."""
    if not _torchrun_works():
        pytest.skip("this torch has no torch.distributed: torchrun is not available")
    env = {**_env(tmp_path), "FALCON_POLICY": "bsp"}
    for k in ("FALCON_HETERO", "FALCON_LR"):
        env.pop(k, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--master_port", str(_free_port()),
        "--nproc_per_node", str(ranks), "--redirects", "1", "--tee", "1",
        str(ROOT / "python" / "tests" / "ddp_tutorial.py"), str(tmp_path / "model.pt"), *extra,
    ]
    return env, cmd


def test_the_ddp_tutorials_checkpoint_demo_runs_with_ranks_as_trainers(tmp_path):
    # PyTorch's DDP tutorial (rank 0 saves, a barrier, the others load; DistributedSampler()
    # with no arguments; the script's own all_reduce) under torchrun: 3 ranks, 3 workers of
    # ranks 0..2, torch.distributed's group the same ranks.
    env, cmd = _tutorial(tmp_path, 3)
    out = _run(cmd, env, TIMEOUT_S)
    rows = [json.loads(m) for m in re.findall(r"TUTORIAL (\{.*\})\s*$", out, re.M)]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2], out[-3000:]
    for r in rows:
        assert r["falcon_rank"] == r["dist_rank"] == r["rank"], r
        assert r["falcon_size"] == r["dist_size"] == 3, r
        assert r["all_reduce"] == 6.0, r
    # Each rank its own third of the data, all of it covered once.
    shares = [r["indices"] for r in rows]
    assert all(len(s) == 20 for s in shares), shares
    assert sorted(i for s in shares for i in s) == list(range(60)), shares
    # Every replica the same model after training.
    assert len({json.dumps(r["params"]) for r in rows}) == 1, rows
    assert "job done" in out, out[-3000:]


def test_ranks_whose_models_differ_in_a_shape_are_refused_naming_it(tmp_path):
    env, cmd = _tutorial(tmp_path, 2, "mismatch")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    refused = re.findall(r"REFUSED (\d): (.*)$", out, re.M)
    assert sorted(r for r, _ in refused) == ["0", "1"], out[-3000:]
    for _, why in refused:
        assert why == ("parameter 'w' is [4, 6] on worker 0 and 'w' [6, 4] on worker 1: the "
                       "workers' models differ"), why


@pytest.mark.parametrize("how", ["int", "term", "raise"])
def test_one_rank_stopped_stops_every_rank_naming_it(tmp_path, how):
    # Three ranks started as a launcher starts them (RANK/WORLD_SIZE/MASTER_*); rank 2 stops
    # itself after 5 steps (Ctrl-C, SIGTERM, or its script raises). Every rank ends, the others
    # with one line naming worker 2 and why, no traceback; each exit is timed.
    port = _free_port()
    env = _env(tmp_path, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", FALCON_POLICY="bsp")
    for k in ("FALCON_HETERO", "FALCON_LR"):
        env.pop(k, None)
    # The rank of python/bench/stop.py (the benchmark times this against DDP).
    script = str(ROOT / "python" / "bench" / "stop.py")
    procs = [subprocess.Popen([sys.executable, script, "--worker", "falcon", how, "30"], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for r in range(3)]
    ended = [None] * 3
    import time
    deadline = time.time() + TIMEOUT_S
    try:
        while None in ended and time.time() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outs = [p.communicate() for p in procs]
    assert None not in ended, f"a rank went on after rank 2 stopped: {outs}"
    stopping = re.search(r"STOPPING ([0-9.]+)", outs[2][0])
    assert stopping, f"rank 2 ended before it stopped the job: {outs[2]}"
    stop = float(stopping.group(1))
    why = {"int": "interrupted (SIGINT)", "term": "terminated (SIGTERM)",
           "raise": "its script raised ValueError: the user's own bug"}[how]
    for r in (0, 1):
        err = outs[r][1]
        assert procs[r].returncode != 0, err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("falcon worker")]
        assert len(lines) == 1 and "worker 2" in lines[0] and why in lines[0], err
    assert procs[2].returncode != 0
    print(f"rank 2 stopped ({how}); ranks ended {[round(t - stop, 2) for t in ended]} s after")
    # A bound on a behaviour (the others do not train on), far above the ~0.1 s seen.
    assert max(ended) - stop < 10, ended
