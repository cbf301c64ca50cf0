"""The package's worker on numpy buffers: values, handles, every error path, the GIL."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest

import falcon
from conftest import free_port


def test_push_pull_values_are_exact_under_bsp(bsp1):
    w = bsp1
    v = np.full(4, 7.0, np.float32)
    w.pull("w", v, 0)
    np.testing.assert_array_equal(v, np.zeros(4, np.float32))
    for clock in range(5):
        w.push("w", np.arange(1, 5, dtype=np.float32), clock)
        w.pull("w", v, clock + 1)
        # SGD at rate 0.5 on the same gradient: w = −0.5 · (clock + 1) · g
        np.testing.assert_allclose(v, -0.5 * (clock + 1) * np.arange(1, 5), rtol=1e-6)
    assert w.clock_of("w") == 5
    assert w.job["policy"] == "bsp" and w.job["optimizer"] == "sgd" and w.job["lr"] == 0.5
    assert w.runs_policy("bsp") and not w.runs_policy("ssp(3)")


def test_push_pull_brings_the_next_clocks_values(bsp1):
    w = bsp1
    v = np.zeros(4, np.float32)
    w.pull("w", v, 0)
    g = np.arange(1, 5, dtype=np.float32)
    for clock in range(3):
        w.push_pull("w", g, v, clock)
        np.testing.assert_allclose(v, -0.5 * (clock + 1) * g, rtol=1e-6)
    assert w.clock_of("w") == 3
    # The module-level call takes the next clock; the gradient may be the output buffer.
    falcon.push_pull("w", v, v)
    np.testing.assert_allclose(v, -1.5 * g + 0.5 * 1.5 * g, rtol=1e-6)
    with pytest.raises(falcon.ClockError):
        w.push_pull("w", g, v, 2)
    with pytest.raises(falcon.LengthError, match="has 4 floats; the buffer has 3"):
        w.push_pull("w", g, np.zeros(3, np.float32), 4)
    with pytest.raises(falcon.TensorError):
        w.push_pull("nope", g, v, 4)
    # Nothing was lost: the next clock still works.
    w.push_pull("w", g, v, 4)
    assert w.clock_of("w") == 5


def test_push_pull_async_hands_back_the_push_then_the_pull(bsp1):
    w = bsp1
    v = np.zeros(4, np.float32)
    w.pull("w", v, 0)
    g = np.arange(1, 5, dtype=np.float32)
    before = w.stats()
    pushed, pulled = w.push_pull_async("w", g, v, 0)
    # The gradient was copied: the caller may reuse it at once.
    g[:] = 100
    pushed.wait()
    pulled.wait()
    np.testing.assert_allclose(v, -0.5 * np.arange(1, 5), rtol=1e-6)
    with pytest.raises(falcon.Error, match="already waited"):
        pulled.wait()
    assert w.clock_of("w") == 1
    # A wrong clock is refused before anything goes out.
    with pytest.raises(falcon.ClockError):
        w.push_pull_async("w", g, v, 0)
    # One push, and its pull answered by the server: no lock-free attempt.
    after = w.stats()
    assert after["pushes"] - before["pushes"] == 1
    assert after["slow_pulls"] - before["slow_pulls"] == 1
    assert after["fast_pulls"] == before["fast_pulls"]


def test_module_level_calls_use_the_next_clock(bsp1):
    falcon.push("w", np.ones(4, np.float32))
    out = np.zeros(4, np.float32)
    falcon.pull("w", out)
    np.testing.assert_allclose(out, -0.5)
    assert falcon.rank() == 0 and falcon.size() == 1


def test_handles_complete_once_and_say_so(bsp1):
    w = bsp1
    h = w.push_async("w", np.ones(4, np.float32), 0)
    h.wait()
    assert h.ready()
    with pytest.raises(falcon.Error, match="already waited"):
        h.wait()
    out = np.zeros(4, np.float32)
    p = w.pull_async("w", out, 1)
    p.wait()
    np.testing.assert_allclose(out, -0.5)
    assert "done" in repr(p)


def test_init_tensor_sets_the_first_values(bsp1):
    w = bsp1
    w.init_tensor("w", np.array([1, 2, 3, 4], np.float32))
    out = np.zeros(4, np.float32)
    w.pull("w", out, 0)
    np.testing.assert_array_equal(out, [1, 2, 3, 4])


def test_every_wrong_input_is_a_typed_error_and_loses_nothing(bsp1):
    w = bsp1
    with pytest.raises(falcon.LengthError, match="has 4 floats; the buffer has 3"):
        w.push("w", np.ones(3, np.float32), 0)
    with pytest.raises(falcon.TensorError, match="float32"):
        w.push("w", np.ones(4, np.float64), 0)
    with pytest.raises(falcon.TensorError, match="contiguous"):
        w.push("w", np.ones(8, np.float32)[::2], 0)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(falcon.LengthError, match="writable"):
        w.pull("w", ro, 0)
    with pytest.raises(falcon.TensorError, match='unknown tensor "x"'):
        w.push("x", np.ones(4, np.float32), 0)
    with pytest.raises(falcon.ClockError, match="the next push is clock 0"):
        w.push("w", np.ones(4, np.float32), 3)
    with pytest.raises(falcon.Error):
        w.push("w", "not a buffer", 0)
    # Nothing was lost or applied by the refused calls.
    w.push("w", np.ones(4, np.float32), 0)
    out = np.zeros(4, np.float32)
    w.pull("w", out, 1)
    np.testing.assert_allclose(out, -0.5)
    for e in (falcon.LengthError, falcon.TensorError, falcon.ClockError, falcon.PeerError):
        assert issubclass(e, falcon.Error)


def test_calls_before_init_say_so():
    falcon.finish()
    with pytest.raises(falcon.NotInitializedError, match="init"):
        falcon.push("w", np.ones(4, np.float32))
    with pytest.raises(falcon.NotInitializedError):
        falcon.declare({"w": 4})


def test_bad_configuration_is_refused_before_anything_starts():
    with pytest.raises(falcon.ConfigError, match="FALCON_POLICY"):
        falcon.local_cluster(workers=1, policy="ssp(x)")
    with pytest.raises(falcon.ConfigError, match="FALCON_NUM_WORKER"):
        falcon.local_cluster(workers=0)
    with pytest.raises(falcon.ConfigError):
        falcon.init({"w": 0}, workers=1, scheduler="127.0.0.1:1", rendezvous_timeout_ms=200)
    falcon.finish()


def test_an_unreachable_scheduler_is_an_error_not_a_hang():
    port = free_port()
    t = time.monotonic()
    with pytest.raises(falcon.Error) as e:
        falcon.init(
            {"w": 4}, workers=1, servers=1, scheduler=f"127.0.0.1:{port}",
            rendezvous_timeout_ms=1500,
        )
    assert time.monotonic() - t < 30
    assert str(e.value) and "Error {" not in str(e.value)
    falcon.finish()


def _two_workers_of_one_process():
    """A BSP job of two workers (rate 1), both joined from this process: (cluster, w0, w1)."""
    c = falcon.local_cluster(workers=2, policy="bsp", lr=1.0)
    ws = [None, None]

    def join(i):
        ws[i] = falcon.Worker.join([("w", 4)], {**c.env, "FALCON_ROLE": "worker", "FALCON_RANK": str(i)})

    ts = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    w0, w1 = ws
    assert w0 is not None and w1 is not None
    return c, w0, w1


def test_the_gil_is_released_while_a_pull_waits():
    """Two workers in one process under BSP: worker 0's pull for clock 1 waits for worker 1's
    push; meanwhile another Python thread counts (it could not if the GIL were held)."""
    c, w0, w1 = _two_workers_of_one_process()
    w0.push("w", np.ones(4, np.float32), 0)
    out = np.zeros(4, np.float32)
    done = threading.Event()

    def pull():
        w0.pull("w", out, 1)
        done.set()

    puller = threading.Thread(target=pull)
    puller.start()
    count = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        count += 1
    assert not done.is_set(), "BSP let clock 1 pull before worker 1 pushed clock 0"
    assert count > 10_000, f"the main thread ran only {count} loops while the pull waited"
    w1.push("w", 3 * np.ones(4, np.float32), 0)
    puller.join(30)
    assert done.is_set()
    np.testing.assert_allclose(out, -2.0)  # mean of 1 and 3 at rate 1
    w0.finish()
    w1.finish()
    c.finish()


def test_a_dead_server_is_an_exception_never_a_hang(procs):
    """A scheduler and a server in processes of their own; the server is killed while the
    worker trains: the worker's next operations raise PeerError (or TimeoutError)."""
    port = free_port()
    env = {
        "FALCON_SCHEDULER": f"127.0.0.1:{port}", "FALCON_NUM_WORKER": "1",
        "FALCON_NUM_SERVER": "1", "FALCON_POLICY": "bsp", "FALCON_JOB": "dead-server",
        "FALCON_TOKEN": "t0k3n", "FALCON_OP_TIMEOUT_MS": "3000",
    }
    procs.serve("scheduler", env)
    server = procs.serve("server", env)
    w = falcon.Worker.join([("w", 4)], {**env, "FALCON_ROLE": "worker"})
    out = np.zeros(4, np.float32)
    w.push("w", np.ones(4, np.float32), 0)
    w.pull("w", out, 1)
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    t = time.monotonic()
    with pytest.raises((falcon.PeerError, falcon.TimeoutError, falcon.TransportError)) as e:
        for clock in range(1, 100):
            w.push("w", np.ones(4, np.float32), clock)
            w.pull("w", out, clock + 1)
    assert time.monotonic() - t < 30
    msg = str(e.value)
    assert "server" in msg or "closed" in msg or "peer" in msg, msg
    print("the worker was told:", msg)
    # The job is over (its scheduler ended with the server): finishing says so, typed.
    try:
        w.finish()
    except falcon.Error as e:
        print("finish:", e)


def test_serving_ranks_end_with_one_line_naming_who_was_lost(procs):
    """A scheduler and a server served by `falcon.init()`; one of two workers is killed for
    good under BSP: each serving rank ends with one line saying who died and was lost (no
    traceback), and the scheduler's rank fails the job (BSP's steps went on without it)."""
    port = free_port()
    env = {
        "FALCON_SCHEDULER": f"127.0.0.1:{port}", "FALCON_NUM_WORKER": "2",
        "FALCON_NUM_SERVER": "1", "FALCON_POLICY": "bsp", "FALCON_JOB": "lost-worker",
        "FALCON_TOKEN": "t0k3n",
    }
    sched = procs.serve("scheduler", env)
    server = procs.serve("server", env)
    victim = procs.start("worker 1", ["-c", (
        "import falcon, numpy as np\n"
        "w = falcon.init({'w': 4}, rank=1)\n"
        "out = np.zeros(4, np.float32)\n"
        "for c in range(100000):\n"
        "    w.push('w', np.ones(4, np.float32), c); w.pull('w', out, c + 1)\n"
        "    if c == 3: print('training', flush=True)\n"
    )], {**env, "FALCON_ROLE": "worker"})
    w = falcon.Worker.join([("w", 4)], {**env, "FALCON_ROLE": "worker", "FALCON_RANK": "0"})
    out = np.zeros(4, np.float32)
    clock = 0
    for clock in range(5):
        w.push("w", np.ones(4, np.float32), clock)
        w.pull("w", out, clock + 1)
    assert victim.stdout.readline().strip() == "training"
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    for clock in range(5, 40):
        w.push("w", np.ones(4, np.float32), clock)
        w.pull("w", out, clock + 1)
    w.finish()
    sched_err = sched.communicate(timeout=30)[1]
    server_err = server.communicate(timeout=30)[1]
    print(sched_err, server_err)
    assert sched.returncode == 1, sched_err
    assert server.returncode == 0, server_err
    for err in (sched_err, server_err):
        assert "Traceback" not in err, err
    lines = [l for l in sched_err.splitlines() if l.startswith("falcon scheduler")]
    assert len(lines) == 2, sched_err
    assert "dead: [worker 1]" in lines[0] and "lost for good: [worker 1]" in lines[0], lines
    assert "the job failed: worker(s) 1 died and never came back" in lines[1], lines
    assert "falcon server 0: workers dead: [1]; rejoined: []; lost for good: [1]" in server_err


def test_a_serving_rank_that_fails_says_why_in_one_line(procs):
    """A server rank whose scheduler address is another program's: one line, no traceback."""
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(4)
    port = foreign.getsockname()[1]

    def answer():
        conn, _ = foreign.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        time.sleep(5)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    env = {"FALCON_SCHEDULER": f"127.0.0.1:{port}", "FALCON_NUM_WORKER": "1",
           "FALCON_NUM_SERVER": "1"}
    server = procs.serve("server", env)
    err = server.communicate(timeout=30)[1]
    assert server.returncode == 1, err
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("falcon server: ") and "is not a falcon scheduler" in lines[0], err
    assert "SSH-2.0" in lines[0], err
    foreign.close()


def test_launch_variables_name_every_launcher():
    names = set(falcon.launch_variables())
    for v in ("FALCON_SCHEDULER", "DMLC_ROLE", "DMLC_PS_ROOT_URI", "RANK", "WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        assert v in names, v


def test_heterogeneity_specs_come_from_python():
    h = falcon.Hetero("h=0.25")
    assert h.per_task and not h.is_none
    assert h.delay(0, 1.0) == pytest.approx(3.0)
    assert falcon.hetero_of("1:h=0.5", 2, 0).is_none
    assert falcon.hetero_of("1:h=0.5", 2, 1).delay(0, 1.0) == pytest.approx(1.0)
    g = falcon.Hetero("gauss(5,2)", seed=3)
    assert g.delay(4, 0.0) == g.delay(4, 0.0) >= 0.0
    with pytest.raises(falcon.ConfigError):
        falcon.Hetero("h=7")


def test_task_source_gives_each_task_once():
    t = falcon.Tasks()
    t.reset(0, 5)
    got = [t.claim() for _ in range(6)]
    assert got == [0, 1, 2, 3, 4, None]
    assert t.remaining() == 0


def test_the_type_stubs_name_what_the_extension_has():
    import ast
    from pathlib import Path

    from falcon import _falcon

    stub = ast.parse((Path(falcon.__file__).parent / "_falcon.pyi").read_text())
    declared = {
        n.name: {m.name for m in n.body if isinstance(m, ast.FunctionDef)}
        for n in stub.body
        if isinstance(n, (ast.ClassDef, ast.FunctionDef))
    }
    public = {n for n in dir(_falcon) if not n.startswith("_")}
    assert set(declared) == public, set(declared) ^ public
    for name, methods in declared.items():
        obj = getattr(_falcon, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            have = {m for m in vars(obj) if not m.startswith("_")}
            assert methods - {"__init__"} == have, f"{name}: {methods ^ have}"


def test_rows_push_and_pull_with_duplicates_summed():
    # A table of 6 rows of 2 (12 floats), SGD at rate 0.5, one worker under BSP.
    c = falcon.local_cluster(workers=1, policy="bsp", lr=0.5)
    w = falcon.init({"emb": 12}, env=c.env)
    rows = np.array([4, 1, 4], np.int64)
    grads = np.array([[1, 2], [3, 4], [10, 20]], np.float32)
    w.push_rows("emb", rows, grads, 0)
    out = np.zeros((2, 2), np.float32)
    w.pull_rows("emb", np.array([4, 1], np.uint64), out, 1)
    # Row 4 got 1+10 and 2+20, row 1 got 3 and 4; the rest of the table did not move.
    np.testing.assert_array_equal(out, -0.5 * np.array([[11, 22], [3, 4]], np.float32))
    everything = np.zeros(12, np.float32)
    w.pull("emb", everything, 1)
    assert np.count_nonzero(everything) == 4
    # The width comes from the values, or is given; bad rows are typed errors.
    w.push_rows("emb", [0], np.ones(2, np.float32), 1, dim=2)
    with pytest.raises(falcon.ConfigError, match="row 6 of tensor"):
        w.push_rows("emb", [6], np.ones(2, np.float32), 2)
    with pytest.raises(falcon.ConfigError, match="row -1 is negative"):
        w.push_rows("emb", [-1], np.ones(2, np.float32), 2)
    with pytest.raises(falcon.LengthError, match="not a whole row each"):
        w.push_rows("emb", [1, 2], np.ones(3, np.float32), 2)
    with pytest.raises(falcon.TensorError, match="float32"):
        w.push_rows("emb", [1], np.ones(2, np.float64), 2)
    falcon.finish()
    c.finish()


def test_wait_news_sleeps_until_something_arrives():
    """A caller waiting for a pull or an offer sleeps in `wait_news` (no polling): the pull's
    answer wakes it long before its timeout; a wait with nothing coming ends at the timeout;
    a bad timeout is a typed error."""
    c, w0, w1 = _two_workers_of_one_process()
    w0.push("w", np.ones(4, np.float32), 0)
    out = np.zeros(4, np.float32)
    h = w0.pull_async("w", out, 1)  # parked: worker 1 has not pushed clock 0
    t0 = time.monotonic()
    seen = w0.news()
    ended = w0.wait_news(seen, 0.3)
    assert time.monotonic() - t0 >= 0.25 or ended != seen
    assert not h.ready()
    threading.Timer(0.2, lambda: w1.push("w", 3 * np.ones(4, np.float32), 0)).start()
    t0 = time.monotonic()
    while True:
        seen = w0.news()
        if h.ready():
            break
        w0.wait_news(seen, 60.0)
        assert time.monotonic() - t0 < 30, "wait_news slept through the pull's answer"
    h.wait()
    np.testing.assert_allclose(out, -2.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(falcon.ConfigError, match="timeout"):
            w0.wait_news(0, bad)
    for bad in (-1, "x", 1.5):
        with pytest.raises(falcon.ConfigError, match="seen"):
            w0.wait_news(bad, 0.01)
    w0.finish()
    w1.finish()
    c.finish()
