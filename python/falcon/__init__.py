"""falcon: a parameter server for training on machines of different speeds.

A job has a scheduler, servers that hold the parameters and apply the updates, and workers
that push gradients and pull parameters under a synchronization policy (bsp, asp, ssp(s),
dssp(…), epsp, fluentps(…), syncopt(n|auto), flexrr, elasticbsp). From Python:

    import falcon, numpy as np

    cluster = falcon.local_cluster(workers=1, policy="bsp", lr=0.5)  # or `falcon role`
    w = falcon.init({"w": 4}, env=cluster.env)   # or from the environment alone
    values = np.zeros(4, np.float32)
    for clock in range(10):
        w.pull("w", values, clock)
        w.push("w", np.ones(4, np.float32), clock)
    w.finish()
    cluster.finish()

`falcon.init()` reads the launch contract from the environment: FALCON_* variables,
ps-lite's DMLC_*, torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Slurm's and Open
MPI's (`falcon.launch_variables()` lists them). Under a launcher that starts the same script
on every rank, every rank is the worker of its rank (N processes, N trainers, as under DDP),
and the scheduler and the servers run beside them on threads: rank 0 hosts the scheduler,
each node's first rank a server (FALCON_HOST_ROLES=0: they were started apart).

PyTorch: `falcon.torch.DistributedOptimizer` (in the manner of Horovod and BytePS) and
`falcon.torch.fit`, the task-driven trainer that moves work from stragglers to fast workers.

Every error is a `falcon.Error`; the subclasses say what kind.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Mapping

from . import _falcon
from ._falcon import (
    ClockError,
    Cluster,
    ConfigError,
    CpuQuota,
    CudaError,
    Error,
    Handle,
    Hetero,
    HostedRoles,
    LengthError,
    NotInitializedError,
    PeerError,
    Tasks,
    TensorError,
    TimeoutError,
    TransportError,
    Worker,
    hetero_of,
    launch_variables,
)

__all__ = [
    "ClockError",
    "Cluster",
    "ConfigError",
    "CpuQuota",
    "CudaError",
    "Error",
    "Handle",
    "Hetero",
    "LengthError",
    "NotInitializedError",
    "PeerError",
    "Tasks",
    "TensorError",
    "TimeoutError",
    "TransportError",
    "Worker",
    "barrier",
    "declare",
    "fashion_mnist",
    "finish",
    "hetero_of",
    "init",
    "is_initialized",
    "launch_variables",
    "local_cluster",
    "pull",
    "pull_async",
    "push",
    "push_async",
    "push_pull",
    "rank",
    "size",
    "worker",
]

_lock = threading.Lock()
_worker: Worker | None = None
_overrides: dict[str, str] | None = None
# What the launch said at init(): this worker's rank (None: the scheduler assigns it) and the
# job's workers.
_launched: dict[str, int | None] = {}
# The scheduler and servers this launched rank hosts (a HostedRoles), until finish().
_hosted = None
# The report of the role this process served (scheduler or server), for tests and tools.
_last_report: dict = {}

# Variables by which a launcher (torchrun, Slurm, Open MPI) gives this process its place.
_LAUNCHER_RANKS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def _settings(
    env: Mapping[str, str] | None,
    scheduler: str | None,
    workers: int | None,
    servers: int | None,
    rank: int | None,
    policy: str | None,
    lr: float | None,
    optimizer: str | None,
    aggregate: str | None,
    job: str | None,
    token: str | None,
    settings: Mapping[str, object],
) -> dict[str, str]:
    """The arguments as launch-contract variables, over `env` (over the process's own)."""
    out = {str(k): str(v) for k, v in (env or {}).items()}
    named = {
        "FALCON_SCHEDULER": scheduler,
        "FALCON_NUM_WORKER": workers,
        "FALCON_NUM_SERVER": servers,
        "FALCON_RANK": rank,
        "FALCON_POLICY": policy,
        "FALCON_LR": lr,
        "FALCON_OPTIMIZER": optimizer,
        "FALCON_AGGREGATE": aggregate,
        "FALCON_JOB": job,
        "FALCON_TOKEN": token,
    }
    for k, v in named.items():
        if v is not None:
            out[k] = str(v)
    for k, s in settings.items():
        name = k.upper()
        if not name.startswith("FALCON_"):
            name = "FALCON_" + name
        out[name] = str(s)
    # DDP's semantics by default: with neither an optimizer nor a rate named (here, in `env`
    # or in the process's environment), the servers only average and each worker applies its
    # own optimizer (`falcon.torch` then trains exactly what the user's code says). Naming
    # the servers' optimizer, or a rate for them (ps-lite's servers apply SGD), is the
    # explicit choice of the servers applying the update.
    if not any(v in out or v in os.environ for v in ("FALCON_OPTIMIZER", "FALCON_LR")):
        out["FALCON_OPTIMIZER"] = "local"
        out["FALCON_LR"] = "1"
    return out


def _tensor_list(tensors) -> list[tuple[str, int]]:
    """(name, length) pairs from a dict of lengths or arrays, or a sequence of pairs."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out = []
    for item in items:
        try:
            name, v = item
        except (TypeError, ValueError):
            raise ConfigError(
                f"a tensor is declared as (name, length): got {item!r}"
            ) from None
        n = v if isinstance(v, int) else getattr(v, "size", None)
        if callable(n):  # torch.Tensor.size is a method; numel() is the count
            n = v.numel()
        if n is None:
            try:
                n = len(v)
            except TypeError:
                raise ConfigError(
                    f"tensor {name!r}: give its length in floats or an array, not {type(v).__name__}"
                ) from None
        out.append((str(name), int(n)))
    return out


def init(
    tensors=None,
    *,
    env: Mapping[str, str] | None = None,
    scheduler: str | None = None,
    workers: int | None = None,
    servers: int | None = None,
    rank: int | None = None,
    policy: str | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
    aggregate: str | None = None,
    job: str | None = None,
    token: str | None = None,
    **settings,
) -> Worker | None:
    """Joins a job as a worker.

    The job is described by the environment (the launch contract), with `env` (a dict of
    variables, such as `local_cluster(...).env`) and the named arguments over it; other
    keyword arguments set FALCON_<NAME> (`heartbeat_ms=500` sets FALCON_HEARTBEAT_MS).

    `tensors` declares what this worker trains: {name: length or array} or [(name,
    length)], the same on every worker. Without it, the join waits for `declare(tensors)`
    (which `falcon.torch.DistributedOptimizer` calls). Returns the Worker, or None when the
    join is deferred.

    With neither FALCON_OPTIMIZER nor FALCON_LR named (here, in `env` or in the process's
    environment) the job is FALCON_OPTIMIZER=local: the servers only average and each worker
    applies its own optimizer (DDP's semantics, what `falcon.torch` needs to train exactly
    what the user's code says); `local_cluster()` defaults the same way.

    A process the launch makes the scheduler or a server serves the job here until it ends
    and then exits (SystemExit(0)): one script can run on every rank of torchrun or srun.
    """
    global _overrides, _hosted
    overrides = _settings(
        env, scheduler, workers, servers, rank, policy, lr, optimizer, aggregate, job, token,
        settings,
    )
    has_role = any(
        overrides.get(v) or os.environ.get(v)
        for v in ("FALCON_ROLE", "DMLC_ROLE") + _LAUNCHER_RANKS
    )
    if not has_role:
        overrides["FALCON_ROLE"] = "worker"
    role, launched_rank, launched_workers = _falcon.launch_role(overrides)
    if role != "worker":
        # A serving rank ends with one line: how the job ended (who died, was evicted,
        # rejoined, lost for good), or why it failed; never a traceback.
        try:
            result = _falcon.serve(overrides)
        except Error as e:
            print(f"falcon {role}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        _last_report.update(result)
        print(f"falcon {result['ending']}", file=sys.stderr, flush=True)
        if result["failure"]:
            print(f"falcon {role}: the job failed: {result['failure']}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        raise SystemExit(0)
    with _lock:
        if _worker is not None or _overrides is not None:
            raise ConfigError("falcon.init() was already called in this process")
        # A launched rank hosts the job's scheduler (rank 0) and servers (each node's first
        # rank) on threads; they serve until every worker has finished.
        if _hosted is None:
            _hosted = HostedRoles.start(overrides)
            if _hosted is not None:
                atexit.register(_finish_at_exit)
        _overrides = overrides
        _launched["rank"], _launched["workers"] = launched_rank, launched_workers
    # torch.distributed's default group of the job's workers, as under DDP (for
    # `DistributedSampler()` and the user's own collectives), where falcon.torch is in use.
    ft = sys.modules.get("falcon.torch")
    if ft is not None:
        ft._on_init(launched_rank, launched_workers)
    if tensors is None:
        return None
    return declare(tensors)


def declare(tensors, dtypes: Mapping[str, str] | None = None) -> Worker:
    """Declares the tensors of a deferred `init()` and joins the job with them; `dtypes`:
    the tensors whose values are 16-bit numbers (name → "bfloat16" or "float16"), which
    travel as 16 bits."""
    global _worker
    with _lock:
        if _worker is not None:
            raise ConfigError("this process has already joined its job")
        if _overrides is None:
            raise NotInitializedError("call falcon.init() before declaring tensors")
        _worker = Worker.join(_tensor_list(tensors), _overrides, dict(dtypes or {}))
        _hold_to_quota(_worker, _overrides)
        _stop_the_job_with_this_process()
        return _worker


# Whether this process stopped the job, or was stopped by another worker's stop: its exit
# then says one line, not the hosted roles' report of the same failure.
_stopped: dict[str, str] = {}
# Whether the hooks that stop the job with this process are in place.
_hooked = False


def _abort(why: str) -> None:
    """This worker stops the whole job (every other worker's next operation fails naming
    it), once."""
    w = _worker
    if w is None or "why" in _stopped:
        return
    _stopped["why"] = why
    try:
        w.abort(why)
    except Error:
        pass  # the job is already over


def _stop_the_job_with_this_process() -> None:
    """A worker interrupted (Ctrl-C, SIGTERM) or whose script raised stops the whole job
    at once, as DDP's ranks do when torchrun tears them down: the others fail with a
    PeerError naming this worker and why, and say so in one line, not a traceback."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            _abort("interrupted (SIGINT)")
            print(f"falcon worker {_rank_or('?')}: interrupted; the job stops",
                  file=sys.stderr, flush=True)
            return
        if issubclass(kind, PeerError) and "stopped the job" in str(value):
            _stopped.setdefault("by", str(value))
            print(f"falcon worker {_rank_or('?')}: {value}", file=sys.stderr, flush=True)
            return
        _abort(f"its script raised {kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = hook
    if threading.current_thread() is threading.main_thread():
        import signal

        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            def on_term(signum, frame):
                _abort("terminated (SIGTERM)")
                print(f"falcon worker {_rank_or('?')}: terminated; the job stops",
                      file=sys.stderr, flush=True)
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, on_term)


def _rank_or(default: str) -> str:
    w = _worker
    return str(w.rank) if w is not None else default


_quota = None
"""This worker process's CPU quota (FALCON_CPU_QUOTA), until finish()."""


def _hold_to_quota(w: Worker, overrides) -> None:
    """FALCON_CPU_QUOTA (`RANKS:CPUS[,...]`, as `falcon local --cpu-quota`): this worker
    process goes into a control group of its own held to its rank's CPUs, a slow machine the
    kernel enforces, until finish(). Where cgroups are not writable it says so and runs at
    full speed."""
    global _quota
    spec = overrides.get("FALCON_CPU_QUOTA") or os.environ.get("FALCON_CPU_QUOTA")
    if not spec:
        return
    cpus = _falcon.cpu_quota_of(spec, w.workers, w.rank)
    if cpus is None:
        return
    try:
        q = CpuQuota(f"falcon-{os.getpid()}-worker-{w.rank}", cpus)
        q.add(os.getpid())
    except Error as e:
        print(f"SKIPPED: FALCON_CPU_QUOTA for worker {w.rank}: {e}; it runs at full speed",
              file=sys.stderr, flush=True)
        return
    _quota = q


def worker() -> Worker:
    """This process's worker; NotInitializedError before `init()` joined."""
    w = _worker
    if w is None:
        if _overrides is None:
            raise NotInitializedError("falcon.init() has not been called in this process")
        raise NotInitializedError(
            "falcon.init() was called without tensors: declare them with falcon.declare(...)"
        )
    return w


def is_initialized() -> bool:
    """Whether `init()` has been called in this process (and `finish()` not yet), as
    Horovod's `hvd.is_initialized()`."""
    return _overrides is not None or _worker is not None


def rank() -> int:
    """This worker's rank: known from `init()` on where the launch gives it (torchrun, srun,
    FALCON_RANK), else once the worker has joined."""
    if _worker is None and _overrides is not None and _launched.get("rank") is not None:
        return _launched["rank"]
    return worker().rank


def size() -> int:
    """The job's workers (known from `init()` on)."""
    if _worker is None and _overrides is not None and _launched.get("workers") is not None:
        return _launched["workers"]
    return worker().workers


def push(tensor: str, grad, clock: int | None = None) -> None:
    """Pushes `grad` for `clock` (default: the tensor's next clock)."""
    w = worker()
    w.push(tensor, grad, w.clock_of(tensor) if clock is None else clock)


def push_async(tensor: str, grad, clock: int | None = None) -> Handle:
    """Starts a push for `clock` (default: the tensor's next clock); returns its Handle."""
    w = worker()
    return w.push_async(tensor, grad, w.clock_of(tensor) if clock is None else clock)


def pull(tensor: str, out, clock: int | None = None) -> None:
    """Pulls into `out` for `clock` (default: the tensor's current clock)."""
    w = worker()
    w.pull(tensor, out, w.clock_of(tensor) if clock is None else clock)


def pull_async(tensor: str, out, clock: int | None = None) -> Handle:
    """Starts a pull into `out` for `clock` (default: the tensor's current clock)."""
    w = worker()
    return w.pull_async(tensor, out, w.clock_of(tensor) if clock is None else clock)


def push_pull(tensor: str, grad, out, clock: int | None = None) -> None:
    """Pushes `grad` for `clock` (default: the tensor's next clock) and pulls the values for
    the clock after it into `out`, each shard's pull right behind its push."""
    w = worker()
    w.push_pull(tensor, grad, out, w.clock_of(tensor) if clock is None else clock)


def barrier() -> None:
    """Waits until every live worker has reached this barrier."""
    worker().barrier()


def finish(timeout: float | None = None) -> None:
    """Tells the job this worker is done. The job ends when every worker is.

    On a rank that hosts the scheduler or servers (under a launcher, rank 0 and each node's
    first rank) it then waits for the job's end, at most `timeout` seconds (None: as long as
    the other workers train), since they serve the whole job; the scheduler's line says how
    the job ended, and a failed job raises."""
    global _worker, _overrides, _quota, _hosted
    with _lock:
        w, _worker, _overrides = _worker, None, None
        q, _quota = _quota, None
    try:
        # The workers' group (and torch.distributed's default one where falcon made it, at
        # init() before joining too) ends with this job: a later init() makes its own.
        ft = sys.modules.get("falcon.torch")
        if ft is not None:
            ft._forget(w)
        if w is not None:
            w.finish()
    finally:
        if q is not None:
            try:
                q.release(os.getpid())
            except Error:
                pass  # left to be removed by the next group made on this host
            q.close()
    h = _hosted
    if h is None:
        return
    result = h.finish(timeout)
    _hosted = None
    _last_report.update(result)
    if result["ending"] and not _stopped:
        print(f"falcon {result['ending']}", file=sys.stderr, flush=True)
    if result["failure"]:
        raise PeerError(f"the job failed: {result['failure']}")


def _finish_at_exit() -> None:
    """A hosting rank whose script ends without finish(): its scheduler and servers still
    serve the others, so the process waits for the job's end (a worker still joined is
    finished first)."""
    if _hosted is None:
        return
    try:
        finish()
    except Error as e:
        if not _stopped:  # a stopped job was said already, in one line
            print(f"falcon: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass


def local_cluster(
    workers: int = 1,
    servers: int = 1,
    policy: str = "bsp",
    *,
    lr: float | None = None,
    optimizer: str | None = None,
    aggregate: str | None = None,
    scheduler: str | None = None,
    job: str | None = None,
    token: str | None = None,
    **settings,
) -> Cluster:
    """Starts a scheduler and `servers` servers on threads of this process, for `workers`
    workers on this host to join: pass `cluster.env` to `init(env=...)` in this process, or
    set it in the environment of worker processes. `cluster.finish()` waits for the job to
    end and returns the roles' reports."""
    overrides = _settings(
        None, scheduler, workers, servers, None, policy, lr, optimizer, aggregate, job, token,
        settings,
    )
    return Cluster(overrides)


def fashion_mnist(path: str | None = None):
    """Fashion-MNIST as numpy arrays: ((train_x, train_y), (test_x, test_y), source), images
    float32 N×28×28 in [0, 1], labels uint8. From `path`, else Debian's full set where
    installed, else the sample bundled with falcon's sources (5000 + 1000 images)."""
    import numpy as np

    d = _falcon.load_fashion_mnist(path)
    shape = (d["rows"], d["cols"])
    # Copies: writable arrays (torch.from_numpy warns on read-only memory).
    tx = np.frombuffer(d["train_images"], dtype="<f4").reshape((-1,) + shape).copy()
    ty = np.frombuffer(d["train_labels"], dtype=np.uint8).copy()
    vx = np.frombuffer(d["test_images"], dtype="<f4").reshape((-1,) + shape).copy()
    vy = np.frombuffer(d["test_labels"], dtype=np.uint8).copy()
    return (tx, ty), (vx, vy), d["source"]
