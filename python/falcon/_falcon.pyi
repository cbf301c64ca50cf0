"""Type stubs of falcon's extension module (`falcon._falcon`); the public names are
re-exported by `falcon`."""

from typing import Any, Mapping, Sequence

class Error(Exception):
    """The base of every error falcon raises; its message is the engine's."""

class ConfigError(Error):
    """A configuration refused: a variable of the launch contract, an argument, a job that
    cannot start."""

class NotInitializedError(Error):
    """A call that needs a worker before falcon.init() (or before the tensors were declared)."""

class TensorError(Error):
    """A tensor name the job does not know."""

class LengthError(Error):
    """A buffer whose length (or type, or layout) does not fit the tensor."""

class ClockError(Error):
    """A push or pull at a clock that is not valid at that moment."""

class PeerError(Error):
    """A peer gone: a dead server or scheduler, an eviction, a refused or failed rendezvous."""

class TimeoutError(Error):
    """An operation past its deadline."""

class TransportError(Error):
    """A transport failure: a link, a socket, a malformed message."""

class CudaError(Error):
    """CUDA unusable for a device tensor: no driver library, no device, a failed driver call."""

class Handle:
    """A push or pull in flight."""

    def wait(self) -> None:
        """Waits for the operation (the GIL released); raises its error if it failed. A
        pull's buffer holds the values when this returns."""
    def ready(self) -> bool:
        """True when `wait()` would return at once."""
    @property
    def age(self) -> float:
        """Seconds since the operation started."""

class Worker:
    """A worker of a falcon job: pushes gradients, pulls parameters. Every method may be
    called from any thread; every wait releases the GIL."""

    @staticmethod
    def join(
        tensors: Sequence[tuple[str, int]],
        overrides: Mapping[str, str],
        dtypes: Mapping[str, str] | None = None,
    ) -> Worker:
        """Joins the job the environment (with `overrides` first) describes, training
        `tensors` (name, length in floats); `dtypes`: tensors whose values are 16-bit
        numbers (name → "bfloat16" or "float16"), which travel as 16 bits, exactly."""
    @property
    def rank(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def tensors(self) -> list[tuple[str, int]]: ...
    @property
    def rejoined(self) -> bool: ...
    @property
    def job(self) -> dict[str, Any]:
        """policy, optimizer, lr (and momentum, betas, eps), aggregate, mode."""
    def runs_policy(self, policy: str) -> bool: ...
    def clock(self) -> int: ...
    def clock_of(self, tensor: str) -> int: ...
    def init_tensor(self, tensor: str, values: Any) -> None: ...
    def push(self, tensor: str, grad: Any, clock: int) -> None:
        """Pushes a float32 buffer (numpy array, CPU tensor) or a CUDA tensor (through
        DLPack: one DMA copy, no host copy of the caller's) for `clock`, the tensor's next
        clock."""
    def push_async(self, tensor: str, grad: Any, clock: int) -> Handle: ...
    def pull(self, tensor: str, out: Any, clock: int) -> None:
        """Pulls into a writable float32 buffer, or a CUDA tensor, the values the policy lets
        `clock` see."""
    def pull_async(self, tensor: str, out: Any, clock: int) -> Handle: ...
    def push_pull(self, tensor: str, grad: Any, out: Any, clock: int) -> None:
        """Pushes `grad` for `clock` and pulls the values for `clock + 1` into `out`, shard
        by shard (each shard's pull right behind its push, answered once the push is applied)."""
    def push_pull_async(self, tensor: str, grad: Any, out: Any, clock: int) -> tuple[Handle, Handle]:
        """Starts a push_pull: the push's handle, then the pull's (`out` holds the values for
        `clock + 1` once the pull's `wait()` returns)."""
    def push_rows(self, tensor: str, rows: Any, grads: Any, clock: int, dim: int | None = None) -> None:
        """Pushes the gradients of some rows (row ids, float32 rows); only they travel."""
    def pull_rows(self, tensor: str, rows: Any, out: Any, clock: int, dim: int | None = None) -> None:
        """Pulls some rows into a writable float32 buffer of len(rows) × dim values."""
    def set_rates(self, lr: float | None = None, weight_decay: float | None = None) -> None:
        """What the next pushes ask of the servers' update, as multiples of the job's: the
        learning rate and AdamW's weight decay (each 1 by default; neither: the job's own)."""
    def barrier(self) -> None: ...
    def finish(self) -> None: ...
    def abort(self, why: str) -> None: ...
    def dead_workers(self) -> list[int]: ...
    def stats(self) -> dict[str, float]: ...
    def serve_steals(self, tasks: Tasks, keep: int = 0) -> None: ...
    def offers(self) -> list[tuple[int, int]]: ...
    def news(self) -> int: ...
    def wait_news(self, seen: int, timeout: float) -> int: ...
    def steal(self, straggler: int, clock: int, want: int) -> tuple[int, int]: ...
    def push_for(self, tensor: str, grad: Any, straggler: int, clock: int) -> None: ...
    def report_iteration(self, threads: int, tasks: int, seconds: float) -> None: ...
    def advised_threads(self) -> int | None: ...

class Cluster:
    """A scheduler and servers on threads of this process (`falcon.local_cluster`)."""

    def __init__(self, overrides: Mapping[str, str]) -> None: ...
    @property
    def address(self) -> str: ...
    @property
    def env(self) -> dict[str, str]: ...
    def finish(self, timeout: float | None = None) -> dict[str, Any]: ...

class HostedRoles:
    """The scheduler and servers a launched rank hosts beside its worker (`falcon.init()`
    under torchrun, srun or mpirun)."""

    @staticmethod
    def start(overrides: Mapping[str, str]) -> HostedRoles | None: ...
    def finish(self, timeout: float | None = None) -> dict[str, Any]: ...

class CpuQuota:
    """A control group holding its processes to `cpus` CPUs (cgroup v1 `cpu` or v2
    `cpu.max`): a slow machine the kernel enforces. Removed by `close()` or at the end of a
    `with` block. Where cgroups are not writable, making one raises an Error that says so."""

    def __init__(self, name: str, cpus: float) -> None: ...
    def add(self, pid: int) -> None:
        """Moves process `pid` (with its threads) into the group."""
    def release(self, pid: int) -> None:
        """Moves process `pid` out of the group."""
    @property
    def path(self) -> str | None: ...
    @property
    def cpus(self) -> float | None: ...
    def close(self) -> None:
        """Removes the group once its processes have left it (ended)."""

class Tasks:
    """The tasks of one iteration: each claimed or taken exactly once."""

    def __init__(self) -> None: ...
    def reset(self, clock: int, m: int) -> None: ...
    def claim(self) -> int | None: ...
    def remaining(self) -> int: ...

class Hetero:
    """How one worker is made slow (`h=H`, `gauss(MEAN_MS,STD_MS)`, `episodes(...)`,
    `trace(...)`)."""

    def __init__(self, spec: str, seed: int = 1) -> None: ...
    def delay(self, iteration: int, compute: float) -> float: ...
    @property
    def per_task(self) -> bool: ...
    @property
    def is_none(self) -> bool: ...

def hetero_of(entries: str, workers: int, rank: int, seed: int = 1) -> Hetero: ...
def cpu_quota_of(quotas: str, workers: int, rank: int) -> float | None: ...
def own_cpus() -> float | None: ...
def launch_variables() -> list[str]: ...
def launch_role(overrides: Mapping[str, str]) -> tuple[str, int | None, int]: ...
def serve(overrides: Mapping[str, str]) -> dict[str, Any]: ...
def load_fashion_mnist(path: str | None = None) -> dict[str, Any]: ...
