"""PyTorch on a falcon job.

Two ways in:

- `DistributedOptimizer(optimizer, model.named_parameters())`, in the manner of Horovod and
  BytePS: the parameters travel in buckets (DDP's fusion), each a tensor of the job; a
  bucket's gradients leave in one exchange as soon as backward has made them all. Two ways to
  apply the optimizer:
  - the servers apply it, where the job names it (`FALCON_OPTIMIZER` sgd, momentum, adam,
    adamw or adagrad, `FALCON_LR`; a `.grad` changed after backward or state in the
    optimizer is then a ConfigError at `step()`; each push carries its parameter group's current rate and decay):
    the wrapped optimizer must describe the same one, its state lives on the servers (one
    copy for the whole job), and `step()` pulls the values the job's policy lets this clock
    see into the parameters;
  - each worker applies its own (the default, `FALCON_OPTIMIZER=local`: DDP's semantics,
    task transfer included): any optimizer, any schedule,
    clipping, a gradient scaler. Under a synchronous policy the servers only average: backward
    ends with `.grad` holding the mean of every worker's gradient (as DDP's does), and
    `step()` is the optimizer's own, the same on every replica; under an asynchronous policy
    `step()` applies the optimizer to this worker's gradient, pushes the change it made and
    pulls the values the policy allows.
  `optimizer_settings(opt)` gives the variables of a job that accepts `opt`.
- `fit(model, loss_fn, data, ...)`, the task-driven trainer: falcon owns the iteration. An
  iteration of a worker is `tasks` tasks, each an index range of the data; a worker blocked by
  the policy takes a straggler's unstarted tasks, computes them on its own weights and pushes
  their gradient credited to the straggler (task transfer, each task exactly once), and the
  scheduler's parallelism manager sets the threads and the tasks in flight of each worker.

Every policy works through both: the staleness rules act on the pulls.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
import warnings
import weakref
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

import falcon as _f

__all__ = [
    "DistributedOptimizer",
    "BUCKET_BYTES",
    "Compression",
    "FitSummary",
    "TaskLoader",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "evaluate",
    "fit",
    "heterogeneity",
    "job_tensors",
    "optimizer_settings",
    "task_examples",
]

_REL = 1e-6


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL * max(1.0, abs(a), abs(b))


LOCAL = {"FALCON_OPTIMIZER": "local", "FALCON_LR": "1"}
"""The settings of a job whose workers each apply their own optimizer."""


def optimizer_settings(optimizer: torch.optim.Optimizer, *, local: bool | None = None) -> dict[str, str]:
    """The launch-contract variables of a job that `DistributedOptimizer(optimizer, ...)`
    accepts: {"FALCON_OPTIMIZER": ..., "FALCON_LR": ...}. Pass them to
    `falcon.local_cluster(**...)` as `optimizer=`/`lr=`, or set them where `falcon role`
    starts the servers.

    The servers apply the optimizer themselves (one state for the whole job) when they can:
    torch.optim.SGD (with or without momentum; no dampening, no Nesterov), torch.optim.Adam
    and torch.optim.AdamW (no amsgrad) and torch.optim.Adagrad (no lr_decay, initial
    accumulator 0); weight decay is added to each gradient on the worker as PyTorch does,
    AdamW's decoupled decay applied by the servers. The job's rate is the first parameter
    group's (and AdamW's decay the largest group's): each push carries its group's rate (a
    schedule) and decay as multiples of them. For any other optimizer — Nesterov, RMSprop,
    LAMB, … — or with `local=True`, the workers apply their own: `{"FALCON_OPTIMIZER":
    "local", "FALCON_LR": "1"}` (see `DistributedOptimizer`). `local=False` insists on the
    servers' (ConfigError when they cannot)."""
    if local:
        return dict(LOCAL)
    try:
        kind, lr, extra = _rule_of(optimizer)
    except _f.ConfigError:
        if local is False:
            raise
        return dict(LOCAL)
    if kind == "sgd":
        text = "sgd"
    elif kind == "momentum":
        text = f"momentum({extra['momentum']!r})"
    elif kind == "adagrad":
        text = f"adagrad({extra['eps']!r})"
    elif kind == "adamw":
        b1, b2 = extra["betas"]
        text = f"adamw({b1!r},{b2!r},{extra['eps']!r},{extra['weight_decay']!r})"
    else:
        b1, b2 = extra["betas"]
        text = f"adam({b1!r},{b2!r},{extra['eps']!r})"
    return {"FALCON_OPTIMIZER": text, "FALCON_LR": repr(lr)}


def _rule_of(optimizer) -> tuple[str, float, dict]:
    """(kind, lr, extra) of a supported optimizer, all parameter groups agreeing."""
    groups = optimizer.param_groups
    if not groups:
        raise _f.ConfigError("the optimizer has no parameter groups")
    name = type(optimizer).__name__
    mro = {c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")}

    def same(key):
        vals = [g.get(key) for g in groups]
        first = vals[0]
        for v in vals[1:]:
            if v != first:
                raise _f.ConfigError(
                    f"{name}: the parameter groups differ in {key} ({first!r} and {v!r}); the "
                    f"servers apply one rule to every tensor"
                )
        return first

    # Groups may differ in their rate (and AdamW's in their decay): each push carries its
    # group's as a multiple of the job's (the first group's).
    lr = float(groups[0]["lr"])
    if lr <= 0:
        raise _f.ConfigError(f"{name}: the first parameter group's learning rate is {lr}; the job's must be > 0")
    if "AdamW" in mro or ("Adam" in mro and same("decoupled_weight_decay")):
        if same("amsgrad"):
            raise _f.ConfigError(f"{name} with amsgrad=True: the servers apply plain AdamW")
        if same("maximize"):
            raise _f.ConfigError(f"{name} with maximize=True is not supported")
        b1, b2 = (float(b) for b in same("betas"))
        wd = max(float(g.get("weight_decay", 0) or 0) for g in groups)
        if wd == 0:  # AdamW without decay is Adam (the servers name it so)
            return "adam", lr, {"betas": (b1, b2), "eps": float(same("eps"))}
        return "adamw", lr, {"betas": (b1, b2), "eps": float(same("eps")), "weight_decay": wd}
    if "SGD" in mro:
        if same("nesterov"):
            raise _f.ConfigError(f"{name} with nesterov=True: the servers apply plain momentum")
        if same("dampening") not in (0, 0.0, None):
            raise _f.ConfigError(f"{name} with dampening: the servers apply no dampening")
        if same("maximize"):
            raise _f.ConfigError(f"{name} with maximize=True is not supported")
        mu = float(same("momentum") or 0.0)
        return ("momentum", lr, {"momentum": mu}) if mu > 0 else ("sgd", lr, {})
    if "Adam" in mro and "AdamW" not in mro:
        if same("amsgrad"):
            raise _f.ConfigError(f"{name} with amsgrad=True: the servers apply plain Adam")
        if same("maximize"):
            raise _f.ConfigError(f"{name} with maximize=True is not supported")
        b1, b2 = (float(b) for b in same("betas"))
        return "adam", lr, {"betas": (b1, b2), "eps": float(same("eps"))}
    if "Adagrad" in mro:
        if same("lr_decay") not in (0, 0.0, None):
            raise _f.ConfigError(f"{name} with lr_decay: the servers apply a constant rate")
        if same("initial_accumulator_value") not in (0, 0.0, None):
            raise _f.ConfigError(
                f"{name} with initial_accumulator_value: the servers' accumulators start at 0"
            )
        if same("maximize"):
            raise _f.ConfigError(f"{name} with maximize=True is not supported")
        return "adagrad", lr, {"eps": float(same("eps"))}
    raise _f.ConfigError(
        f"the servers apply SGD (with or without momentum), Adam, AdamW or Adagrad; {name} "
        f"is none of them: start the job with FALCON_OPTIMIZER=local (each worker applies its "
        f"own optimizer), or wrap torch.optim.SGD, Adam, AdamW or Adagrad"
    )


def _holds_state(st) -> bool:
    """Whether a parameter's optimizer state is more than a fresh optimizer's (Adagrad makes
    zero accumulators and a zero step at construction): any nonzero value."""
    for v in st.values():
        if isinstance(v, torch.Tensor):
            if v.numel() and bool(torch.any(v != 0)):
                return True
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0:
            return True
    return False


def _refuse_state(optimizer, job: Mapping) -> None:
    """The servers hold the job's optimizer state: state in the worker's optimizer (loaded
    before or after wrapping) would be silently dropped, so it is refused."""
    held = [p for p, st in optimizer.state.items() if _holds_state(st)]
    if held:
        raise _f.ConfigError(
            f"the optimizer holds state for {len(held)} parameters (loaded from a checkpoint?), "
            f"but the job's servers apply the optimizer ({job['optimizer']}, FALCON_OPTIMIZER) "
            f"and keep its state themselves: the loaded state would be dropped. Leave "
            f"FALCON_OPTIMIZER unset (each worker applies its own optimizer, state included, "
            f"as DDP), or resume the servers from their own checkpoint"
        )


def _check_rule(optimizer, job: Mapping) -> float:
    """Checks `optimizer` against the job's servers; returns the rate the job was given
    (FALCON_LR: asynchronous policies apply each gradient at that rate / workers, which the
    job's `lr_per_push` says). A job whose workers apply their own optimizer takes any."""
    if job["optimizer"] == "local":
        if job["mode"] == "sync" and job["aggregate"] == "sum":
            raise _f.ConfigError(
                "the job's servers sum the workers' gradients (FALCON_AGGREGATE=sum); each "
                "worker's optimizer needs their mean: start the job with FALCON_AGGREGATE=mean"
            )
        return 1.0
    try:
        kind, lr, extra = _rule_of(optimizer)
    except _f.ConfigError as e:
        raise _f.ConfigError(f"{e} (the job's servers apply {job['optimizer']})") from None
    name = type(optimizer).__name__
    if job["mode"] == "sync" and job["aggregate"] == "sum":
        raise _f.ConfigError(
            "the job's servers sum the workers' gradients (FALCON_AGGREGATE=sum), a step as "
            "many times the optimizer's as there are workers: start the job with "
            "FALCON_AGGREGATE=mean"
        )
    wanted = optimizer_settings(optimizer)
    fix = f"start the job with FALCON_OPTIMIZER={wanted['FALCON_OPTIMIZER']} FALCON_LR={wanted['FALCON_LR']}"
    if kind != job["optimizer"]:
        raise _f.ConfigError(
            f"the job's servers apply {job['optimizer']}, the optimizer is {name} ({kind}): {fix}"
        )
    if kind == "momentum" and not _close(extra["momentum"], job["momentum"]):
        raise _f.ConfigError(
            f"the job's servers apply momentum {job['momentum']}, the optimizer has "
            f"{extra['momentum']}: {fix}"
        )
    if kind in ("adam", "adamw"):
        if not all(_close(a, b) for a, b in zip(extra["betas"], job["betas"])) or not _close(
            extra["eps"], job["eps"]
        ):
            raise _f.ConfigError(
                f"the job's servers apply {kind}{tuple(job['betas']) + (job['eps'],)}, the "
                f"optimizer has betas {extra['betas']} and eps {extra['eps']}: {fix}"
            )
    if kind == "adamw" and extra["weight_decay"] > 0 and not job["weight_decay"] > 0:
        raise _f.ConfigError(
            f"the job's servers apply AdamW without weight decay, the optimizer has "
            f"{extra['weight_decay']}: {fix}"
        )
    if kind == "adagrad" and not _close(extra["eps"], job["eps"]):
        raise _f.ConfigError(
            f"the job's servers apply adagrad({job['eps']}), the optimizer has eps "
            f"{extra['eps']}: {fix}"
        )
    # Any rate: each push carries its group's as a multiple of the job's.
    return float(job["lr"])


def _worker_for(named: Sequence[tuple[str, torch.Tensor]], worker) -> "_f.Worker":
    """The worker to use: the given one, this process's, or a deferred init() joined now
    with these tensors."""
    if worker is not None:
        w = worker
    elif _f._worker is not None:
        w = _f._worker
    else:
        w = _f.declare([(n, p.numel()) for n, p in named])
    declared = dict(w.tensors)
    for n, p in named:
        if n not in declared:
            raise _f.TensorError(
                f"parameter {n!r} is not a tensor of this job (it has {sorted(declared)})"
            )
        if declared[n] != p.numel():
            raise _f.LengthError(
                f"parameter {n!r} has {p.numel()} values; the job's tensor has {declared[n]}"
            )
    _check_shapes(w, named)
    return w


def _check_shapes(w, named) -> None:
    """Under a launcher (where falcon made torch.distributed's group) every worker's
    parameters have the same shapes: the servers see only lengths, so a model whose layers
    differ in shape alone would mix silently. A difference is a ConfigError on every rank
    naming the tensor, both shapes and both ranks."""
    pg = _DEFAULT.get("pg")
    if pg is None or w.workers == 1:
        return
    import torch.distributed as dist

    mine = [(n, tuple(p.shape)) for n, p in named]
    every: list = [None] * w.workers
    dist.all_gather_object(every, mine, group=pg)
    for r, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        for (n0, s0), (n1, s1) in zip(every[0], theirs):
            if (n0, s0) != (n1, s1):
                raise _f.ConfigError(
                    f"parameter {n0!r} is {list(s0)} on worker 0 and {n1!r} {list(s1)} on "
                    f"worker {r}: the workers' models differ"
                )
        raise _f.ConfigError(
            f"worker 0 has {len(every[0])} parameters and worker {r} {len(theirs)}: the "
            "workers' models differ"
        )


# Parameter types that train through the servers: 16-bit values are exact in float32 (the
# servers average them there and the step's mean is rounded once to the parameter's type)
# and travel as 16 bits. float64 ones would be rounded there: their gradients are averaged
# in the workers' gloo group, in float64, as DDP's are.
_DTYPES = {torch.float32: None, torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_param(name: str, p: torch.Tensor) -> None:
    if p.dtype not in _DTYPES and p.dtype != torch.float64 and p.is_floating_point():
        raise _f.TensorError(
            f"parameter {name!r} is {p.dtype}: falcon trains float32, bfloat16, float16 and "
            f"float64 parameters"
        )
    if p.device.type not in ("cpu", "cuda"):
        raise _f.ConfigError(
            f"parameter {name!r} is on {p.device}: falcon moves CPU and CUDA tensors"
        )
    if not p.is_contiguous():
        raise _f.TensorError(f"parameter {name!r} is not contiguous")


def _named(params) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from named_parameters(), a state_dict or a list of pairs."""
    items = params.items() if isinstance(params, Mapping) else params
    out = []
    for item in items:
        try:
            n, p = item
        except (TypeError, ValueError):
            raise _f.ConfigError(
                "parameters are given as (name, tensor) pairs: model.named_parameters() or "
                "model.state_dict()"
            ) from None
        out.append((str(n), p))
    return out


def _wait_all(handles) -> None:
    """Waits for every handle (none is left running when one fails); raises the first error."""
    errors = []
    for h in handles:
        try:
            h.wait()
        except _f.Error as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _view(t: torch.Tensor):
    """What a pull writes in place: a CPU float32 tensor's numpy view (no copy), or a CUDA
    tensor itself (moved through DLPack, one DMA copy)."""
    t = t.detach()
    return t if t.is_cuda else t.numpy()


def broadcast_parameters(params, root_rank: int = 0, worker=None) -> None:
    """Makes every worker's parameters rank `root_rank`'s: the root sets the servers'
    initial values (the first initialization of a tensor wins), every worker waits at a
    barrier and pulls them. `params`: model.named_parameters(), model.state_dict() or (name,
    tensor) pairs: float32 tensors the job holds move through the servers; every other one (integer
    and 16/64-bit tensors, BatchNorm's step counter, a state_dict's buffers once the job has
    joined) through the workers' own group, as Horovod's. Joins a deferred `init()` with the
    float32 tensors."""
    named = _named(params)
    for n, p in named:
        if not isinstance(p, torch.Tensor):
            raise _f.TensorError(f"{n!r} is a {type(p).__name__}, not a tensor")
    _by_name(named)
    # A DistributedOptimizer's parameters (Horovod's order: wrap, rank 0 loads, broadcast).
    owner = {ptr: o for o in list(_LIVE) for ptr in o._falcon_ptrs}
    wrapped = [(n, p, owner[p.data_ptr()]) for n, p in named if p.data_ptr() in owner]
    named = [(n, p) for n, p in named if p.data_ptr() not in owner]
    if wrapped:
        _broadcast_wrapped(wrapped, root_rank)
        if not named:
            return
    # Tensors the job does not hold (integer and 16/64-bit ones, BatchNorm's step counter,
    # buffers of a state_dict once the job has joined) travel in the workers' own group.
    known = worker if worker is not None else _f._worker
    joined = dict(known.tensors) if known is not None else {}

    def own(n, p):
        return p.dtype == torch.float32 and (not joined or n in joined)

    other = [(n, p) for n, p in named if not own(n, p)]
    named = [(n, p) for n, p in named if own(n, p)]
    if not named:
        if not other:
            return
        w = known if known is not None else _f.worker()
    else:
        for n, p in named:
            _check_param(n, p)
        w = _worker_for(named, worker)
    if not 0 <= root_rank < w.workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {w.workers}")
    if other:
        pg = _group(w)
        if pg is not None:
            _bcast(pg, [p.data if isinstance(p, torch.nn.Parameter) else p for _, p in other], root_rank)
    if not named:
        return
    if not 0 <= root_rank < w.workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {w.workers}")
    if w.rejoined:
        # The job is running: take its current values.
        for n, p in named:
            w.pull(n, _view(p.data), w.clock_of(n))
        return
    if w.rank == root_rank:
        for n, p in named:
            w.init_tensor(n, _view(p.data))
    w.barrier()
    handles = [w.pull_async(n, _view(p.data), w.clock_of(n)) for n, p in named]
    for h in handles:
        h.wait()
    # Nobody pushes before everyone has the values (an asynchronous policy would let the
    # root's first update into a slower worker's start).
    w.barrier()


def broadcast_object(obj, root_rank: int = 0, worker=None):
    """Rank `root_rank`'s `obj` (anything picklable) on every worker, as Horovod's
    `broadcast_object`; through the workers' gloo group."""
    pg, rank, workers = _group_here(worker)
    if not 0 <= root_rank < workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {workers}")
    if pg is None:
        return obj
    return _bcast_object(pg, obj, root_rank, rank)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, worker=None) -> torch.Tensor:
    """Rank `root_rank`'s values of `tensor` (any dtype) written into every worker's, in
    place, as Horovod's `broadcast_`; through the workers' gloo group. Returns `tensor`."""
    pg, _, workers = _group_here(worker)
    if not 0 <= root_rank < workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {workers}")
    if pg is not None:
        _bcast(pg, [tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor], root_rank)
    return tensor


def _group_here(worker):
    """(the workers' group, this worker's rank, the workers): the joined worker's, or before
    a deferred `init()` joins, the launch's (its rank and size known from init())."""
    w = worker if worker is not None else _f._worker
    if w is not None:
        return _group(w), w.rank, w.workers
    rank, workers = _f.rank(), _f.size()
    if workers == 1:
        return None, rank, workers
    pg = _DEFAULT.get("pg") or _default_group(rank, workers)
    if pg is None:
        pg = _own_group(rank, workers)
    return pg, rank, workers


def broadcast(tensor: torch.Tensor, root_rank: int = 0, worker=None) -> torch.Tensor:
    """As `broadcast_`, into a new tensor (Horovod's `broadcast`)."""
    return broadcast_(tensor.detach().clone(), root_rank, worker)


class _NamesError(_f.ConfigError, ValueError):
    """Parameters named twice or not named: a ValueError too, as Horovod raises."""


def _by_name(named) -> dict:
    """`named` as a dict; a name given twice is a _NamesError."""
    out: dict = {}
    for n, p in named:
        if n in out:
            raise _NamesError(
                f"{n!r} names two parameters: each needs a name of its own (two modules' "
                f"named_parameters() chained? prefix them)"
            )
        out[n] = p
    return out


def _broadcast_wrapped(wrapped, root_rank: int) -> None:
    """`broadcast_parameters` for parameters a DistributedOptimizer holds. Each worker's own
    optimizer under a synchronous policy: the workers hold the values, and rank `root_rank`'s
    become everyone's (through the workers' group), whatever was loaded since wrapping. Where
    the servers hold the values (their optimizer, or an asynchronous policy), the root's must
    already be everyone's: a value loaded on the root alone after wrapping could not reach
    the servers, so it is a ConfigError, never a quiet difference."""
    w = wrapped[0][2]._falcon_worker
    if not 0 <= root_rank < w.workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {w.workers}")
    pg = _group(w)
    if pg is None:
        return
    mine = [p.data if isinstance(p, torch.nn.Parameter) else p for _, p, o in wrapped if o._falcon_local and o._falcon_sync]
    if mine:
        _bcast(pg, mine, root_rank)
    held = [(n, p) for n, p, o in wrapped if not (o._falcon_local and o._falcon_sync)]
    if held:
        theirs = [p.detach().clone() for _, p in held]
        _bcast(pg, theirs, root_rank)
        differ = next((n for (n, p), t in zip(held, theirs) if not torch.equal(p.detach(), t)), None)
        # Every worker says whether it differs, so that all of them raise or none.
        flag = torch.tensor([0 if differ is None else 1], dtype=torch.int64)
        try:
            pg.allreduce([flag]).wait()
        except RuntimeError as e:
            raise _f.PeerError(f"a broadcast among the workers failed: {e}") from None
        if int(flag) > 0:
            raise _f.ConfigError(
                f"{differ or 'a parameter'!r} on worker {root_rank} differs from another worker's after "
                f"DistributedOptimizer was made, and the job's servers hold the parameters "
                f"({w.job['optimizer']}, {w.job['policy']}): the root's values cannot reach them. "
                f"Load the checkpoint before wrapping (on every rank, or on rank 0 followed by "
                f"broadcast_parameters), or leave FALCON_OPTIMIZER unset"
            )


def broadcast_optimizer_state(optimizer, root_rank: int = 0, worker=None) -> None:
    """Makes every worker's optimizer agree with rank `root_rank`'s.

    Each worker applying its own optimizer (the default): rank `root_rank`'s state_dict
    (momentum, Adam's moments, the parameter groups' hyperparameters) is loaded into every
    worker's, through the workers' own group. The servers applying it: its state lives on
    the servers, one copy for the whole job; the rule is checked against the job's servers
    (ConfigError when it differs) and state held by the worker's optimizer is refused (it
    would be dropped: a job resumes the servers' state from their checkpoints)."""
    w = worker if worker is not None else _f.worker()
    if not 0 <= root_rank < w.workers:
        raise _f.ConfigError(f"root rank {root_rank} is not a worker of a job of {w.workers}")
    inner = getattr(optimizer, "_falcon_base", optimizer)
    _check_rule(inner, w.job)
    if w.job["optimizer"] != "local":
        _refuse_state(optimizer, w.job)
        w.barrier()
        return
    # Each worker applies its own optimizer: rank `root_rank`'s state and hyperparameters
    # (loaded before or after wrapping) become every worker's, as Horovod's.
    pg = _group(w)
    if pg is not None:
        state = _bcast_object(pg, optimizer.state_dict(), root_rank, w.rank)
        if w.rank != root_rank:
            optimizer.load_state_dict(state)
    w.barrier()


# --- the workers' own group: buffers, optimizer state, tensors of any dtype -----------------

_GROUPS: dict = {}
"""The gloo group of each worker of this process (by id of the falcon Worker)."""

_STORE_TIMEOUT_S = 120


def _store_address() -> tuple[str, int, bool]:
    """Where the workers' group meets: (host, port, whether worker 0 hosts the store).
    Under torchrun its agent's store (MASTER_ADDR:MASTER_PORT); else the scheduler's host,
    the port after the scheduler's, hosted by worker 0 (which then runs on the scheduler's
    host, as a launcher's rank 0 does)."""
    env = {**os.environ, **(_f._overrides or {})}
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"]), False
    # FALCON_SCHEDULER: HOST:PORT, or a local cluster's `host=…;tcp=IP:PORT;shm=…`.
    parts = [p.strip() for p in (env.get("FALCON_SCHEDULER") or "").split(";")]
    sched = next((p[4:] for p in parts if p.startswith("tcp=")), None)
    if sched is None:
        sched = next((p for p in parts if ":" in p and "=" not in p), None)
    if sched:
        host, port = sched.rsplit(":", 1)
    elif env.get("DMLC_PS_ROOT_URI") and env.get("DMLC_PS_ROOT_PORT"):
        host, port = env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"]
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
    else:
        raise _f.ConfigError(
            "the workers need a group of their own (to broadcast buffers, optimizer state or "
            "tensors that are not float32) and no address says where it meets: set "
            "FALCON_SCHEDULER=HOST:PORT, run under torchrun, or pass broadcast_buffers=False "
            "where each worker's buffers may stay its own"
        )
    try:
        return host.strip("[]"), int(port) + 1, True
    except ValueError:
        raise _f.ConfigError(f"the scheduler's port {port!r} is not a number") from None


def _group(w):
    """This worker's gloo group of the job's workers (rank = falcon rank), made on first
    use; None for a job of one worker. Used where the parameter server has no say: buffers
    (BatchNorm's statistics), the optimizer's state, integer and 16/64-bit tensors. Where
    torch.distributed has no default group yet, this group becomes it (as under DDP, so that
    `DistributedSampler()` and the user's own collectives see the job's workers)."""
    if w.workers == 1:
        return None
    held = _GROUPS.get(id(w))
    if held is not None and held[0] is w:
        return held[1]
    pg = _default_group(w.rank, w.workers)
    if pg is None:
        pg = _own_group(w.rank, w.workers)
    _GROUPS[id(w)] = (w, pg)
    return pg


def _stores(rank: int, workers: int):
    """The workers' meeting store (a PrefixStore of the job) and where it is, in words."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        raise _f.ConfigError("this PyTorch has no torch.distributed: buffers and state cannot be broadcast")
    timeout = datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    if workers == 1:
        return dist.HashStore(), "this process", timeout
    host, port, hosts = _store_address()
    try:
        store = dist.TCPStore(host, port, None if not hosts else workers, hosts and rank == 0, timeout)
    except (RuntimeError, OSError) as e:
        raise _f.PeerError(
            f"the workers' group (gloo) at {host}:{port} could not be formed by worker {rank}: {e}"
        ) from None
    job = (_f._overrides or {}).get("FALCON_JOB") or os.environ.get("FALCON_JOB") or "falcon"
    return dist.PrefixStore(f"falcon/{job}/", store), f"{host}:{port}", timeout


def _own_group(rank: int, workers: int):
    """A gloo group of the job's workers apart from torch.distributed's default one (which
    the user made)."""
    import torch.distributed as dist

    store, where, timeout = _stores(rank, workers)
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore("own/", store), rank, workers, timeout)
    except (RuntimeError, OSError) as e:
        raise _f.PeerError(
            f"the workers' group (gloo) at {where} could not be formed by worker {rank}: {e}"
        ) from None


def _default_group(rank: int, workers: int):
    """torch.distributed's default group as the job's workers (gloo, rank = falcon rank),
    made here where none exists; None where the user made one (falcon then keeps a group of
    its own, `_own_group`)."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if dist.is_initialized():
        return _DEFAULT.get("pg")
    store, where, timeout = _stores(rank, workers)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("default/", store), rank=rank,
                                world_size=workers, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as e:
        raise _f.PeerError(
            f"torch.distributed's group (gloo) at {where} could not be formed by worker {rank}: {e}"
        ) from None
    pg = dist.distributed_c10d._get_default_group()
    _DEFAULT["pg"] = pg
    return pg


_DEFAULT: dict = {}
"""torch.distributed's default group where falcon made it."""


def _on_init(rank, workers) -> None:
    """falcon.init() under a launcher (the rank known before joining): torch.distributed's
    default group of the job's workers, for `DistributedSampler()` and the user's own
    collectives, unless the user made one."""
    if rank is None or workers is None:
        return
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        _default_group(rank, workers)


def _forget(w) -> None:
    """The worker finished: its group goes with it (and torch.distributed's default group
    where falcon made it)."""
    _GROUPS.pop(id(w), None)
    if _DEFAULT.pop("pg", None) is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


_BITS = {torch.bfloat16: torch.float16, torch.int16: torch.float16, torch.bool: torch.uint8}


def _bcast(pg, tensors, root: int) -> None:
    """Broadcasts `tensors` (of any dtype; CPU or CUDA: moved through the CPU) from `root`,
    coalesced into one message per dtype."""
    import torch.distributed as dist

    by: dict = {}
    for t in tensors:
        by.setdefault(t.dtype, []).append(t)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    for dtype, ts in by.items():
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in ts])
        try:
            # Gloo has no bfloat16, int16 or bool: their bits travel as a type of their size (a
            # broadcast copies bits, never computes).
            as_bits = _BITS.get(dtype)
            pg.broadcast([flat.view(as_bits) if as_bits is not None else flat], opts).wait()
        except RuntimeError as e:
            raise _f.PeerError(f"a broadcast among the workers failed: {e}") from None
        off = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n


def _bcast_object(pg, obj, root: int, rank: int):
    """`obj` of `root` on every worker (pickled through a byte tensor)."""
    import io
    import pickle

    if rank == root:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    _bcast(pg, [n], root)
    if rank != root:
        data = torch.empty(int(n), dtype=torch.uint8)
    _bcast(pg, [data], root)
    if rank == root:
        return obj
    try:
        return torch.load(io.BytesIO(data.numpy().tobytes()))
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise _f.PeerError(f"worker {root}'s broadcast could not be read: {e}") from None


# --- fusion: the job's tensors are buckets of parameters -----------------------------------

class Compression:
    """Horovod's compression choices for `DistributedOptimizer(compression=...)`: `none`, or
    `fp16` (each gradient and the step's mean travel as float16; the servers average in
    float32)."""

    class none:
        """Gradients travel in the job's precision (FALCON_WIRE, float32 by default)."""

        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class fp16:
        """Gradients and the step's mean travel as float16 (infinities kept). `compress`
        and `decompress` are Horovod's, for a script's own use: a floating tensor to float16
        and back to its type."""

        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point:
                return tensor.type(torch.float16), tensor.dtype
            return tensor, tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


BUCKET_BYTES = 1 << 20
"""The default size of a bucket of parameters (FALCON_BUCKET_BYTES sets another; 0 keeps one
tensor per parameter). Chosen by measurement: python/bench/many_tensors.py --sweep."""


def _bucket_bytes(value) -> int:
    if value is None:
        text = os.environ.get("FALCON_BUCKET_BYTES")
        if text is None:
            return BUCKET_BYTES
        try:
            value = int(text)
        except ValueError:
            raise _f.ConfigError(
                f"FALCON_BUCKET_BYTES={text!r}: a bucket's size is a number of bytes (0: one "
                f"tensor per parameter)"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _f.ConfigError(
            f"bucket_bytes={value!r}: a bucket's size is a number of bytes, 0 or more (0: one "
            f"tensor per parameter)"
        )
    return value


def _row_params(model) -> set[int]:
    """The parameters whose gradients PyTorch makes sparse: the weights of
    `nn.Embedding(sparse=True)` and `nn.EmbeddingBag(sparse=True)` of `model`."""
    if model is None:
        return set()
    return {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    }


def _plan(optimizer, named, bucket_bytes: int, rows: set[int]) -> list[tuple[str, list[int]]]:
    """The job's tensors for `named`: (name, indices into `named`). With `bucket_bytes` 0,
    one tensor per parameter, named as it. Otherwise, as DDP's buckets: the parameters in
    reverse order (the order backward makes their gradients), those of one parameter group,
    device and trainability together, a bucket closed once it holds `bucket_bytes`;
    named `bucket:<its first parameter>+<its parameters>` (two optimizers on one worker need
    parameters named apart, as they would unfused). A sparse embedding's weight is a tensor of its own (its
    gradient travels as rows)."""
    if bucket_bytes == 0:
        return [(n, [i]) for i, (n, _) in enumerate(named)]
    group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    order = [i for i in reversed(range(len(named))) if named[i][1].requires_grad]
    order += [i for i in range(len(named)) if not named[i][1].requires_grad]
    plan: list[tuple[str, list[int]]] = []
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], list[int]]] = {}
    for i in order:
        n, p = named[i]
        if id(p) in rows:
            plan.append((n, [i]))
            continue
        key = (group_of.get(id(p)), str(p.device), p.requires_grad, p.dtype)
        if key not in open_:
            open_[key] = ([], [0])
            buckets.append(open_[key][0])
        members, size = open_[key]
        members.append(i)
        size[0] += 4 * p.numel()
        if size[0] >= bucket_bytes:
            del open_[key]
    for members in buckets:
        plan.append((f"bucket:{named[members[0]][0]}+{len(members)}", members))
    return plan


def job_tensors(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int | None = None,
    model: torch.nn.Module | None = None,
) -> list[tuple[str, int]]:
    """The tensors a worker declares (`falcon.Worker.join(...)`, `falcon.init(tensors=...)`)
    for `DistributedOptimizer(optimizer, named_parameters, bucket_bytes=..., model=...)` to
    train them in buckets: [(name, length)]. A deferred `falcon.init()` needs none of this:
    `DistributedOptimizer` declares them itself."""
    named = _named(named_parameters)
    plan = _plan(optimizer, named, _bucket_bytes(bucket_bytes), _row_params(model))
    return [(name, sum(named[i][1].numel() for i in idx)) for name, idx in plan]


class _Bucket:
    """Parameters moved as one tensor of the job. Their values are views into `values` and
    their gradients views into `grads` (as DDP's gradient_as_bucket_view), so a pull writes
    every parameter at once and a push reads every gradient at once; `rows`: a sparse
    embedding's weight, alone, whose gradient travels as rows."""

    __slots__ = (
        "name", "params", "names", "values", "grads", "gviews", "trainable", "expect", "count",
        "fired", "sent", "none", "mean", "group", "rows", "slices", "cast", "ptr",
    )

    def __init__(self, name, named, group, per_step, rows=False):
        self.name = name
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.group = group
        self.rows = rows
        self.trainable = sum(1 for p in self.params if p.requires_grad)
        self.expect = self.trainable * per_step
        self.count = 0
        self.fired = [False] * len(self.params)
        self.sent = False
        self.none = False
        self.mean = None
        first = self.params[0]
        total = sum(p.numel() for p in self.params)
        self.slices = []
        # 16-bit parameters keep their own storage and type: the bucket holds their values
        # and gradients as float32 (exactly), copied in and out.
        self.cast = first.dtype != torch.float32 and not rows
        # Where its first parameter's values lie (the bucket's, or a 16-bit parameter's own):
        # a model moved or converted after wrapping moves them.
        self.ptr = first.data_ptr()
        if rows:
            self.values = first.detach().view(-1)
            self.grads = None
            self.gviews = [None]
            self.slices = [(0, total)]
            return
        self.values = torch.empty(total, dtype=torch.float32, device=first.device)
        self.grads = torch.zeros(total, dtype=torch.float32, device=first.device)
        self.gviews = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.slices.append((off, n))
                v = self.values[off : off + n]
                v.copy_(p.detach().reshape(-1))
                gv = self.grads[off : off + n].view_as(p)
                if p.grad is not None:
                    gv.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                if self.cast:
                    self.gviews.append(None)
                else:
                    p.data = v.view_as(p)
                    if p.grad is not None:
                        p.grad = gv
                    self.gviews.append(gv)
                off += n
        self.ptr = first.data_ptr()

    def adopt(self, i: int) -> None:
        """Makes parameter `i`'s gradient the view into `grads` again (a new tensor after
        `zero_grad(set_to_none=True)` by hand, a gradient set by the user, a sparse one):
        copied in, or zeros for none."""
        p, gv = self.params[i], self.gviews[i]
        g = p.grad
        if g is gv:
            return
        off, n = self.slices[i]
        with torch.no_grad():
            dst = self.grads[off : off + n]
            if g is None:
                dst.zero_()
                return
            dst.copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
        # A 16-bit parameter's `.grad` stays its own (copied in as float32, exactly).
        if not self.cast:
            p.grad = gv

    def to_params(self, src) -> None:
        """A 16-bit bucket: `src` (float32, the bucket's layout) into its parameters, rounded
        once to their type."""
        with torch.no_grad():
            for (off, n), p in zip(self.slices, self.params):
                p.copy_(src[off : off + n].view_as(p))

    def mean_to_grads(self, mean) -> None:
        """A 16-bit bucket: the step's mean (float32) into each `.grad`, rounded once to the
        parameter's type."""
        for (off, n), p in zip(self.slices, self.params):
            if p.requires_grad:
                _set_grad(p, mean[off : off + n].view_as(p))

    def complete(self) -> None:
        """Before a push that not every parameter's hook started: what each `.grad` holds
        (zeros for none) is in `grads`."""
        for i, p in enumerate(self.params):
            if not self.fired[i]:
                self.adopt(i)

    def unfired_to_none(self, mean=None) -> None:
        """`zero_grad(set_to_none=True)` semantics for the parameters backward did not reach:
        no gradient (the optimizer skips them) where the step's mean for them is zero."""
        if not self.none or self.count >= self.expect:
            return
        for i, p in enumerate(self.params):
            if self.fired[i] or not p.requires_grad:
                continue
            off, n = self.slices[i]
            if mean is None or not bool(torch.any(mean[off : off + n] != 0)):
                p.grad = None

    def reset(self) -> None:
        self.count = 0
        self.fired = [False] * len(self.params)
        self.sent = False


def _set_grad(p: torch.Tensor, mean: torch.Tensor) -> None:
    """The step's mean into `p.grad`, in `p`'s type and place (rounded once where `mean` is
    wider); a parameter without a gradient gets one where the mean is not zero."""
    with torch.no_grad():
        if p.grad is None or p.grad.is_sparse:
            if p.grad is not None or bool(torch.any(mean != 0)):
                p.grad = mean.to(device=p.device, dtype=p.dtype, copy=True)
        else:
            p.grad.copy_(mean)


_LIVE: "weakref.WeakSet" = weakref.WeakSet()
"""The DistributedOptimizers alive: broadcast_parameters leaves their parameters alone."""


class _Distributed:
    """Methods mixed into the user's optimizer class (as Horovod does), so learning-rate
    schedulers and `isinstance` checks keep working."""

    def _falcon_setup(
        self, named, policy, worker, backward_passes_per_step, model, bucket_bytes, tasks=None,
        loss_fn=None, compute=None, broadcast_buffers=True, compression=None,
        sparse_as_dense=False,
    ):
        if compression is None:
            compression = Compression.none
        if compression not in (Compression.none, Compression.fp16):
            raise _f.ConfigError("compression= takes falcon.torch.Compression.none or .fp16")
        if backward_passes_per_step < 1:
            raise _f.ConfigError("backward_passes_per_step must be at least 1")
        if tasks is not None:
            if not isinstance(tasks, TaskLoader):
                raise _f.ConfigError("tasks= takes a falcon.torch.TaskLoader")
            if tasks._opt is not None:
                raise _f.ConfigError("this TaskLoader already feeds another DistributedOptimizer")
            if backward_passes_per_step != 1:
                raise _f.ConfigError(
                    "a TaskLoader's batch is one step: backward_passes_per_step must be 1"
                )
            if (compute is None) == (loss_fn is None or model is None):
                raise _f.ConfigError(
                    "tasks= needs a way to compute a task: model= and loss_fn= (the loss is "
                    "loss_fn(model(inputs), targets)), or compute= (a callable taking a batch "
                    "and returning its mean loss), not both"
                )
            if tasks._transfer and model is not None:
                bn = next(
                    (n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)),
                    None,
                )
                if bn is not None:
                    raise _f.ConfigError(
                        f"task transfer splits an iteration's batch between workers, and "
                        f"BatchNorm ({bn or 'the model'}) normalises by the whole batch's "
                        f"statistics: the step would not be the one your code describes. Use "
                        f"TaskLoader(..., transfer=False), or a norm of each example "
                        f"(LayerNorm, GroupNorm)"
                    )
        elif loss_fn is not None or compute is not None:
            raise _f.ConfigError("loss_fn= and compute= go with tasks= (a TaskLoader)")
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        named = [(n, p) for n, p in named if id(p) in mine]
        if not named:
            raise _NamesError("none of the named parameters is in the optimizer")
        names = _by_name(named)
        if len({id(p) for _, p in named}) != len(named):
            raise _NamesError("a parameter is named twice")
        if len(named) != len(mine):
            raise _NamesError(
                f"the optimizer has {len(mine)} parameters, {len(named)} of them named: pass "
                f"model.named_parameters() for every parameter the optimizer trains"
            )
        for n, p in named:
            _check_param(n, p)
        # float64 parameters: averaged in the workers' group (in float64), not on the servers;
        # integer ones (never trained: no gradient) only broadcast from rank 0 there.
        self._falcon_wide = [
            p for _, p in named if p.dtype == torch.float64 or not p.is_floating_point()
        ]
        wide = self._falcon_wide_ids = {id(p) for p in self._falcon_wide}
        f64 = next((n for n, p in named if p.dtype == torch.float64), None)
        held = [(n, p) for n, p in named if id(p) not in wide]
        if not held:
            # Every parameter is float64: the job still keeps its clock (and its policy's
            # rules) with a tensor of its own, one float the servers average each step.
            held = [("falcon:float64-step", torch.zeros(1))]
        if f64 is not None and tasks is not None and tasks._transfer:
            raise _f.ConfigError(
                f"parameter {f64!r} is torch.float64: "
                f"a helper's gradient for a straggler's tasks travels through the servers, in "
                f"float32; use TaskLoader(..., transfer=False), or float32 parameters"
            )
        # With task transfer a helper pushes a dense gradient of a straggler's tasks: sparse
        # embeddings travel dense too.
        rows = _row_params(model) if tasks is None and not sparse_as_dense else set()
        plan = _plan(self, held, _bucket_bytes(bucket_bytes), rows)
        w, plan = _join(held, plan, worker, compression is Compression.fp16)
        _check_shapes(w, named)
        job = w.job
        if policy is not None and not w.runs_policy(policy):
            raise _f.ConfigError(
                f"this job runs {job['policy']}, not {policy}: the policy is the job's, set "
                f"where its scheduler starts (FALCON_POLICY)"
            )
        self._falcon_job_lr = _check_rule(self, job)
        if job["optimizer"] != "local":
            _refuse_state(self, job)
            if w.rank == 0:
                # The servers applying the optimizer changes what trains (their state, no
                # change to `.grad` after backward): said in the job's output, once.
                print(
                    f"falcon.torch: the servers apply the optimizer ({job['optimizer']}, "
                    f"FALCON_OPTIMIZER); its state lives on the servers and any change to .grad "
                    f"after backward is refused; leave FALCON_OPTIMIZER and FALCON_LR unset for "
                    f"DDP's semantics (each worker applies its own optimizer)",
                    file=sys.stderr, flush=True,
                )
        self._falcon_kind = job["optimizer"]
        self._falcon_job = job
        self._falcon_worker = w
        self._falcon_named = named
        # Each worker applies its own optimizer (FALCON_OPTIMIZER=local).
        self._falcon_local = job["optimizer"] == "local"
        self._falcon_sync = job["mode"] == "sync"
        if self._falcon_local and w.rejoined:
            raise _f.ConfigError(
                "this worker rejoined a running job whose workers apply their own optimizer: "
                "the parameters and the optimizer's state live on the workers, not on the "
                "servers, so there is nothing to rejoin from; restart the job (from your own "
                "checkpoint)"
            )
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        row_job = self._falcon_kind in ("sgd", "adagrad") and not self._falcon_local
        self._falcon_buckets: list[_Bucket] = []
        self._falcon_slot: dict[int, tuple[_Bucket, int]] = {}
        for name, idx in plan:
            members = [held[i] for i in idx]
            p0 = members[0][1]
            is_rows = id(p0) in rows and len(members) == 1 and row_job
            group = group_of.get(id(p0), self.param_groups[0])
            b = _Bucket(name, members, group, backward_passes_per_step, is_rows)
            self._falcon_buckets.append(b)
            for i, (_, p) in enumerate(members):
                self._falcon_slot[id(p)] = (b, i)
        self._falcon_by_name = {b.name: b for b in self._falcon_buckets}
        cast = next(((b.names[0], b.params[0]) for b in self._falcon_buckets if b.cast), None)
        if cast is None and f64 is not None:
            cast = (f64, names[f64])
        if compression is Compression.fp16 and not (self._falcon_local and self._falcon_sync):
            raise _f.ConfigError(
                "compression=Compression.fp16 sends the step's mean gradient as float16 with "
                "each worker's own optimizer under a synchronous policy; here the servers' "
                "values are the parameters, which it would round: start the job with "
                "FALCON_WIRE=f16 to round them too, knowingly"
            )
        if cast is not None and not (self._falcon_local and self._falcon_sync):
            # The servers keep float32 values: applying an optimizer or adding each worker's
            # change there would train float32 master weights, not the parameters' own type.
            raise _f.ConfigError(
                f"parameter {cast[0]!r} is {cast[1].dtype}: 16- and 64-bit parameters train "
                f"with each worker's own optimizer under a synchronous policy (the default: "
                f"leave FALCON_OPTIMIZER and FALCON_LR unset; bsp, epsp); this job runs "
                f"{job['policy']} with the optimizer {job['optimizer']}"
            )
        self._falcon_ptrs = {p.data_ptr() for _, p in named}
        self._falcon_handles: dict[str, object] = {}
        # The pull half of each push_pull started this step (the values for the next clock),
        # kept until step() hands them to the forward pass.
        self._falcon_next: dict[str, object] = {}
        self._falcon_per_step = backward_passes_per_step
        self._falcon_hooks = []
        # Each worker's own optimizer under a synchronous policy: the values are the workers',
        # and a 16-bit wire (FALCON_WIRE, Compression.fp16) is for the gradients only.
        # A job already under way (a model wrapped again under the same names): the servers'
        # values are the last step's mean gradient, never parameters, so rank 0's values
        # reach the others through the workers' group too.
        rounded = [
            b for b in self._falcon_buckets
            if self._falcon_local and self._falcon_sync and not b.rows
            and (
                w.clock_of(b.name) > 0
                or (not b.cast and (job.get("wire", "f32") != "f32" or compression is Compression.fp16))
            )
        ]
        _broadcast_buckets(self._falcon_buckets, w, rounded)
        if self._falcon_wide and w.workers > 1:
            _bcast(_group(w), [p.data for p in self._falcon_wide], 0)
        self._falcon_clock = min(w.clock_of(b.name) for b in self._falcon_buckets)
        # Whether a backward is under way; what `.grad` held at its end (the servers apply
        # the optimizer: checked at step()).
        self._falcon_in_backward = False
        self._falcon_snap = None
        # Tasks of stragglers taken while waiting for the step's mean (each worker's own
        # optimizer), computed once the step is made: (owner, clock, tasks).
        self._falcon_later: list = []
        self._falcon_held = 0.0
        self._falcon_waited = False
        if self._falcon_local:
            for b in self._falcon_buckets:
                b.mean = torch.empty_like(b.values)
            # Backward passes since the last exchange; whether the step's mean is in `.grad`
            # (until step()).
            self._falcon_backwards = 0
            self._falcon_averaged = False
        # Pulls go out in the order of first use in the forward pass (learnt from the first
        # forward with a model; the buckets' order until then) and, with a model, each
        # module waits only for its own parameters' buckets: the next forward starts while
        # later layers' values are still arriving (priority scheduling, as P3 and
        # ByteScheduler).
        self._falcon_pending: dict[str, object] = {}
        self._falcon_first_use: list[str] = []
        self._falcon_seen: set[str] = set()
        self._falcon_model_hooks = []
        if model is not None:
            for module in model.modules():
                own = []
                for p in module.parameters(recurse=False):
                    slot = self._falcon_slot.get(id(p))
                    if slot is not None and slot[0].name not in own:
                        own.append(slot[0].name)
                if own:
                    self._falcon_model_hooks.append(
                        module.register_forward_pre_hook(self._falcon_pre_forward(own))
                    )
            for module in model.modules():
                if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                    slot = self._falcon_slot.get(id(module.weight))
                    if slot is not None and slot[0].rows:
                        self._falcon_model_hooks.append(
                            module.register_forward_pre_hook(self._falcon_row_pull(slot[0]))
                        )
        # Asynchronous with each worker's own optimizer, step() pushes what it changed:
        # backward's gradients are the optimizer's alone, no hook needed.
        hooked = not (self._falcon_local and not self._falcon_sync)
        # Task transfer (a TaskLoader): this step's share of the iteration's batch (the tasks
        # computed here; helpers push the rest), how to compute a task, and whether a task
        # of a straggler is being computed (the hooks stand aside).
        self._falcon_share = 1.0
        self._falcon_helping = False
        self._falcon_tasks = tasks
        self._falcon_model = model
        self._falcon_loss_fn = loss_fn
        self._falcon_compute = compute
        for n, p in named:
            if not (p.requires_grad and hooked):
                continue
            hook = self._falcon_hook_for(p) if id(p) not in wide else self._falcon_wide_hook()
            if hasattr(p, "register_post_accumulate_grad_hook"):  # PyTorch ≥ 2.1
                self._falcon_hooks.append(p.register_post_accumulate_grad_hook(hook))
            else:  # the gradient accumulator's hook, as Horovod does on older PyTorch
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._falcon_hooks.append(acc.register_hook(hook))
                self._falcon_hooks.append(acc)  # keep the accumulator alive
        # Buffers (BatchNorm's running statistics, any registered buffer) are rank 0's on
        # every worker after each step, as DDP's broadcast_buffers: the model's, or without
        # a model those of the modules that own these parameters, found in the first forward.
        self._falcon_buffers: list = []
        self._falcon_finding = None
        if broadcast_buffers and w.workers > 1:
            if model is not None:
                self._falcon_buffers = list(model.buffers())
                if self._falcon_buffers:
                    _bcast(_group(w), self._falcon_buffers, 0)
            else:
                self._falcon_finding = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._falcon_find_buffers
                )
        self._falcon_synced = False
        self._falcon_skip = False
        self._falcon_no_sync = False
        _LIVE.add(self)

    def _falcon_find_buffers(self, module, _inputs):
        own, wide = self._falcon_slot, self._falcon_wide_ids
        if any(id(p) in own or id(p) in wide for p in module.parameters(recurse=False)):
            seen = {id(b) for b in self._falcon_buffers}
            self._falcon_buffers += [b for b in module.buffers(recurse=False) if id(b) not in seen]

    def _falcon_sync_buffers(self) -> None:
        """After a step: every worker's buffers are rank 0's."""
        if self._falcon_finding is not None:
            self._falcon_finding.remove()
            self._falcon_finding = None
            if not self._falcon_buffers:
                return
            # Every worker found the same (the same model): one count checks it.
            pg = _group(self._falcon_worker)
            n = torch.tensor([len(self._falcon_buffers)], dtype=torch.int64)
            mine = int(n)
            _bcast(pg, [n], 0)
            if int(n) != mine:
                raise _f.ConfigError(
                    f"worker 0's model has {int(n)} buffers, worker {self._falcon_worker.rank}'s "
                    f"{mine}: the workers train different models"
                )
        if self._falcon_buffers:
            _bcast(_group(self._falcon_worker), self._falcon_buffers, 0)

    def _falcon_pre_forward(self, names):
        def hook(*_):
            if self._falcon_helping:
                return
            seen = self._falcon_seen
            for n in names:
                if n not in seen:
                    seen.add(n)
                    self._falcon_first_use.append(n)
            pending = self._falcon_pending
            if pending:
                for n in names:
                    h = pending.pop(n, None)
                    if h is not None:
                        h.wait()

        return hook

    @property
    def pull_order(self) -> list[str]:
        """The order in which `step()` pulls the job's tensors (buckets, or parameters with
        `bucket_bytes=0`): first use in the forward pass (known once a forward ran with
        `model=` given), then the rest in their own order."""
        names = self._falcon_by_name
        used = [n for n in self._falcon_first_use if n in names]
        seen = set(used)
        return used + [b.name for b in self._falcon_buckets if b.name not in seen]

    @property
    def buckets(self) -> list[tuple[str, list[str]]]:
        """The job's tensors this optimizer moves and the parameters in each: [(tensor,
        [parameter names])]."""
        return [(b.name, list(b.names)) for b in self._falcon_buckets]

    def wait_pulls(self) -> None:
        """Waits for the pulls `step()` left in flight (with `model=`, the forward pass waits
        for each module's own; call this before reading parameters any other way)."""
        pending, self._falcon_pending = self._falcon_pending, {}
        _wait_all(pending.values())

    def _falcon_hook_for(self, p):
        """The gradient hook of `p`: the common case (a bucket's view filled, the bucket not
        yet sent) inline, every other case through `_falcon_ready`."""
        b, i = self._falcon_slot[id(p)]
        gv = b.gviews[i]
        if b.rows:
            return lambda *_: self._falcon_ready(p)

        def hook(*_):
            if self._falcon_no_sync:
                return
            if b.sent or p.grad is not gv:
                return self._falcon_ready(p)
            b.fired[i] = True
            b.count += 1
            if b.count >= b.expect:
                self._falcon_full(b)

        def first_hook(*_):
            if self._falcon_no_sync:
                return
            if not self._falcon_in_backward:
                self._falcon_begin()
            hook()

        return first_hook

    def _falcon_wide_hook(self):
        """The gradient hook of a float64 parameter: its gradient stays in `.grad` (averaged
        in the workers' group at the end of backward); the first of a backward starts the
        exchange as a bucket's does."""

        def hook(*_):
            if not self._falcon_in_backward and not self._falcon_helping and not self._falcon_no_sync:
                self._falcon_begin()

        return hook

    def _falcon_average_wide(self) -> None:
        """float64 parameters: each `.grad` becomes the mean of every worker's, in float64
        through the workers' gloo group (divided by the workers first, then summed, as DDP's
        buckets are); a parameter without a gradient gets one where another worker's had
        one."""
        w = self._falcon_worker
        params = [p for p in self._falcon_wide if p.requires_grad]
        if not params or w.workers == 1:
            return
        pg = _group(w)
        with torch.no_grad():
            flat = torch.cat(
                [
                    (p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1).cpu()
                    if p.grad is not None
                    else torch.zeros(p.numel(), dtype=p.dtype)
                    for p in params
                ]
            )
            flat.div_(w.workers)
            try:
                pg.allreduce([flat]).wait()
            except RuntimeError as e:
                raise _f.PeerError(f"averaging the float64 gradients among the workers failed: {e}") from None
            off = 0
            for p in params:
                _set_grad(p, flat[off : off + p.numel()].view_as(p))
                off += p.numel()

    def _falcon_gradient(self, b: _Bucket) -> torch.Tensor:
        """The bucket's gradient to push, weight decay added as PyTorch adds it (AdamW's
        decoupled decay is the servers'); the push asks for the group's rate and decay as
        multiples of the job's (`_falcon_rates`)."""
        group = b.group
        job = self._falcon_job
        if self._falcon_kind == "momentum" and not _close(float(group["momentum"]), job["momentum"]):
            raise _f.ConfigError(
                f"the momentum changed to {group['momentum']}; the servers apply "
                f"{job['momentum']} (a momentum schedule, such as OneCycleLR's "
                f"cycle_momentum, does not reach them: turn it off)"
            )
        if self._falcon_kind in ("adam", "adamw") and not all(
            _close(float(a), b) for a, b in zip(group["betas"], job["betas"])
        ):
            raise _f.ConfigError(
                f"Adam's betas changed to {tuple(group['betas'])}; the servers apply "
                f"{tuple(job['betas'])} (a momentum schedule does not reach them: turn it off)"
            )
        # A bucket of frozen parameters asks for no decoupled decay (PyTorch's AdamW skips
        # a parameter without a gradient; one that backward merely missed this step is
        # decayed with its bucket).
        self._falcon_rates(group, decays=b.trainable > 0)
        wd = 0 if self._falcon_kind == "adamw" else (group.get("weight_decay", 0) or 0)
        g = b.grads
        if self._falcon_share != 1.0:
            # The tasks computed here are this share of the iteration's batch (helpers push
            # the rest); the decay is the whole step's, added once.
            g = g * self._falcon_share
        if wd:
            with torch.no_grad():
                g = g.clone() if g is b.grads else g
                g.add_(b.values, alpha=wd)
                if b.count < b.expect or not b.trainable:
                    # No decay for a parameter without a gradient (PyTorch skips it).
                    for i, p in enumerate(b.params):
                        if not b.fired[i] and (p.grad is None or b.none):
                            off, n = b.slices[i]
                            g[off : off + n] = 0
        return g

    def _falcon_rates(self, group, decays: bool = True) -> None:
        """Asks the next push for `group`'s learning rate (its schedule) and, under AdamW, its
        decoupled weight decay (none where `decays` is false: a bucket of frozen parameters),
        as multiples of the job's. The setting is the worker's: made right before each push
        (another optimizer on the same worker may have set its own)."""
        lr = float(group["lr"]) / self._falcon_job_lr
        wd = 1.0
        if self._falcon_kind == "adamw":
            job_wd = self._falcon_job["weight_decay"]
            wd = (float(group.get("weight_decay", 0) or 0) / job_wd) if job_wd > 0 else 0.0
            if not decays:
                wd = 0.0
        self._falcon_worker.set_rates(lr=lr, weight_decay=wd)

    def _falcon_ready(self, p):
        slot = self._falcon_slot.get(id(p))
        if slot is None:
            return
        b, i = slot
        if b.rows:
            return self._falcon_push_rows(b, p)
        if b.sent:
            # Refused, typed: what this backward accumulated is the user's to handle.
            self._falcon_snap = None
            self._falcon_in_backward = False
            raise _f.ClockError(
                f"the gradient of {b.names[i]!r} is ready again before step(): call step() "
                f"after each backward, or pass backward_passes_per_step=N to accumulate N"
            )
        if p.grad is not b.gviews[i]:
            b.adopt(i)
        b.fired[i] = True
        b.count += 1
        if b.count >= b.expect:
            self._falcon_full(b)

    def _falcon_full(self, b: _Bucket):
        """Backward has made every gradient of `b`: it leaves."""
        self._falcon_send(b)

    def _falcon_begin(self):
        """Each worker's own optimizer, synchronous policy: the first gradient of a backward.
        A backward after an exchange that no `step()` followed (a gradient scaler that found
        infinities skips the step) is the next exchange. The backward that completes the
        step's passes (`backward_passes_per_step`) ends waiting for the mean of every
        gradient, as DDP's does, whether or not a bucket filled during it."""
        self._falcon_in_backward = True
        engine = torch.autograd.Variable._execution_engine
        if not self._falcon_local:
            engine.queue_callback(self._falcon_backward_done)
            return
        if self._falcon_averaged:
            self._falcon_averaged = False
        self._falcon_backwards += 1
        if self._falcon_backwards >= self._falcon_per_step:
            engine.queue_callback(self._falcon_average)
        else:
            engine.queue_callback(self._falcon_end_pass)

    def _falcon_end_pass(self):
        self._falcon_in_backward = False

    def _falcon_backward_done(self):
        """The servers apply the optimizer: backward's gradients are what they receive, so
        what `.grad` holds now is kept to check at `step()` that nothing changed it."""
        self._falcon_in_backward = False
        with torch.no_grad():
            self._falcon_snap = [None if b.rows else b.grads.clone() for b in self._falcon_buckets]

    def _falcon_check_grads(self) -> None:
        """The servers apply the optimizer: a change to `.grad` after backward (clipping, a
        gradient scaler's unscaling, a gradient set by hand) cannot reach them, so it is an
        error, never a quiet difference."""
        _refuse_state(self, self._falcon_job)
        self._falcon_in_backward = False
        snap, self._falcon_snap = self._falcon_snap, None
        if snap is None:
            return
        for b, before in zip(self._falcon_buckets, snap):
            if before is None:
                continue
            changed = not torch.equal(b.grads, before)
            if not changed:
                changed = any(
                    p.grad is not None and p.grad is not b.gviews[i] for i, p in enumerate(b.params)
                )
            if changed:
                raise _f.ConfigError(
                    f"the gradient of {b.names[0]!r} changed after backward (clipping, a "
                    f"gradient scaler, a gradient set by hand?), but the job's servers apply the "
                    f"optimizer ({self._falcon_job['optimizer']}, FALCON_OPTIMIZER) to the "
                    f"gradients backward made: the change would be silently lost. Leave "
                    f"FALCON_OPTIMIZER unset (each worker applies its own optimizer to the mean "
                    f"gradient, as DDP), or change nothing between backward() and step(). This step "
                    f"was made without the change"
                )

    def _falcon_send(self, b: _Bucket):
        """Pushes the bucket's gradient and asks, in the same exchange, for the values of the
        next clock into its parameters (server-side optimizers; written when step() or the
        forward pass waits for them) or for the step's mean gradient (each worker's own
        optimizer under a synchronous policy; the servers leave the mean as the values)."""
        pending = self._falcon_pending.pop(b.name, None)
        if pending is not None:
            # The last step's values land before this step's are asked for.
            pending.wait()
        if b.count < b.expect or not b.trainable:
            b.complete()
        if self._falcon_local:
            g, out = b.grads, b.mean
            if self._falcon_share != 1.0:
                g = g * self._falcon_share
        else:
            g, out = self._falcon_gradient(b), b.values
        pushed, pulled = self._falcon_worker.push_pull_async(
            b.name, _view(g), _view(out), self._falcon_clock
        )
        b.sent = True
        self._falcon_handles[b.name] = pushed
        self._falcon_next[b.name] = pulled

    # --- sparse embeddings: rows -------------------------------------------------------

    def _falcon_row_pull(self, b: _Bucket):
        """The forward pre-hook of a sparse embedding: pulls the rows its input uses (the
        values the policy lets this clock see) into its weight before it reads them."""

        def hook(module, inputs):
            pending = self._falcon_pending.pop(b.name, None)
            if pending is not None:
                pending.wait()
            ids = inputs[0]
            if not isinstance(ids, torch.Tensor):
                return
            rows = torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64))
            if rows.numel() == 0:
                return
            weight = module.weight
            dim = weight.shape[1]
            out = torch.empty(rows.numel(), dim, dtype=torch.float32)
            self._falcon_worker.pull_rows(b.name, rows.numpy(), out.numpy(), self._falcon_clock, dim)
            with torch.no_grad():
                weight.index_copy_(0, rows.to(weight.device), out.to(weight.device))

        return hook

    def _falcon_push_rows(self, b: _Bucket, p):
        """A sparse embedding's gradient: only the rows it touches travel (duplicates summed,
        weight decay added and the rate's schedule carried, as for every gradient)."""
        if b.sent:
            raise _f.ClockError(
                f"the gradient of {b.names[0]!r} is ready again before step(): call step() "
                f"after each backward"
            )
        b.count += 1
        if b.count < b.expect:
            return
        self._falcon_send_rows(b, p)

    def _falcon_send_rows(self, b: _Bucket, p):
        g = p.grad
        dim = p.shape[1]
        self._falcon_rates(b.group)
        wd = b.group.get("weight_decay", 0) or 0
        with torch.no_grad():
            if g is None:
                rows = torch.empty(0, dtype=torch.int64)
                vals = torch.empty(0, dim)
            elif g.is_sparse:
                g = g.coalesce()
                rows, vals = g.indices()[0], g.values()
            else:
                rows = torch.nonzero(g.abs().sum(1)).reshape(-1)
                vals = g.index_select(0, rows)
            rows = rows.to("cpu", torch.int64)
            vals = vals.to("cpu", torch.float32)
            if wd:
                vals = vals + wd * p.detach().index_select(0, rows.to(p.device)).cpu()
            vals = vals.contiguous()
        self._falcon_worker.push_rows(b.name, rows.numpy(), vals.numpy(), self._falcon_clock, dim)
        b.sent = True

    # --- each worker's own optimizer ---------------------------------------------------

    def _falcon_average(self):
        """Local optimizers, synchronous policy: sends what backward did not (a parameter
        without a gradient sends zeros), waits for every exchange, and puts each parameter's
        mean gradient in `.grad` — a parameter without a gradient here gets one where another
        worker's had one. Runs at the end of backward, or from step()."""
        self._falcon_in_backward = False
        self._falcon_backwards = 0
        if self._falcon_averaged:
            return
        for b in self._falcon_buckets:
            if not b.sent:
                self._falcon_send(b)
        handles, self._falcon_handles = self._falcon_handles, {}
        means, self._falcon_next = self._falcon_next, {}
        waiting = list(handles.values()) + list(means.values())
        loader = self._falcon_tasks
        if loader is not None and loader._transfer:
            # Task transfer with each worker's own optimizer: while the policy holds the
            # step's mean back, take the tasks of a straggler's next iteration; they are
            # computed once the user's step() has made this step (the loader's next batch).
            more, held = self._falcon_steal_wait(waiting, self._falcon_clock)
            self._falcon_later += more
            self._falcon_held += held
            self._falcon_waited = True
        _wait_all(waiting)
        self._falcon_average_wide()
        with torch.no_grad():
            for b in self._falcon_buckets:
                b.grads.copy_(b.mean)
                if b.cast:
                    b.mean_to_grads(b.mean)
                else:
                    for i, p in enumerate(b.params):
                        if p.requires_grad and p.grad is None:
                            off, n = b.slices[i]
                            if bool(torch.any(b.mean[off : off + n] != 0)):
                                p.grad = b.gviews[i]
                b.unfired_to_none(b.mean)
                b.reset()
        self._falcon_clock += 1
        self._falcon_averaged = True

    def _falcon_local_step(self, closure):
        """step() with each worker's own optimizer."""
        if self._falcon_sync:
            if closure is None:
                self._falcon_average()
                self._falcon_averaged = False
                return super().step()

            def again():
                # Each evaluation's backward is an exchange of its own (L-BFGS evaluates
                # several times a step, every replica alike).
                self._falcon_averaged = False
                return closure()

            loss = super().step(again)
            self._falcon_averaged = False
            return loss
        # Asynchronous: this worker's optimizer on its own gradient, then the change it made
        # goes to the servers, which add it (scaled by 1 / workers), and the values the
        # policy allows come back into the parameters.
        self.wait_pulls()
        before = [b.values.clone() for b in self._falcon_buckets]
        loss = super().step(closure)
        w = self._falcon_worker
        handles = {}
        with torch.no_grad():
            for b, change in zip(self._falcon_buckets, before):
                change.sub_(b.values)
                pushed, pulled = w.push_pull_async(
                    b.name, _view(change), _view(b.values), self._falcon_clock
                )
                handles[b.name] = pushed
                self._falcon_next[b.name] = pulled
        _wait_all(handles.values())
        self._falcon_next_clock()
        return loss

    def _falcon_next_clock(self):
        """The step is pushed: the clock moves on, and the pulls that went out with the
        pushes (one exchange per bucket) are handed to the forward pass, which takes the
        values in the order of first use (without a model, they are waited for now)."""
        self._falcon_clock += 1
        nxt, self._falcon_next = self._falcon_next, {}
        for n in self.pull_order:
            h = nxt.pop(n, None)
            if h is not None:
                self._falcon_pending[n] = h
        # With a TaskLoader its next batch waits for them (taking a straggler's tasks while
        # the policy holds this worker back).
        if not self._falcon_model_hooks and self._falcon_tasks is None:
            self.wait_pulls()

    # --- task transfer in the user's loop (a TaskLoader) -----------------------------------

    def _falcon_help_wait(self) -> None:
        """Before the loader's next batch: waits for the pulls step() left in flight (the
        servers apply the optimizer), taking a straggler's tasks while the policy holds them
        back, then computes the tasks of the straggler's next iteration taken while waiting
        (here, or at the end of backward while waiting for the step's mean with each worker's
        own optimizer) on the values this step made — that iteration's values."""
        loader = self._falcon_tasks
        pending = self._falcon_pending
        later, self._falcon_later = self._falcon_later, []
        held, self._falcon_held = self._falcon_held, 0.0
        waited, self._falcon_waited = self._falcon_waited, False
        if pending and loader._transfer:
            # The parameters hold the last clock's values; the pulls bring this clock's.
            more, h = self._falcon_steal_wait(list(pending.values()), self._falcon_clock - 1)
            later += more
            held += h
            waited = True
        self.wait_pulls()
        for straggler, clock, tasks in later:
            took = self._help_timed(straggler, clock, tasks)
            loader.stats["helping_s"] += took
            held += took
        if waited:
            loader._held_s = held if loader._held_s is None else 0.75 * loader._held_s + 0.25 * held

    def _falcon_steal_wait(self, handles, values_at: int) -> tuple[list, float]:
        """Waits for `handles`; while the policy holds them back, takes a straggler's
        unstarted tasks the servers offer (task transfer). Tasks of the iteration the
        straggler is about to start (its loader opened them to helpers when it started the one
        it is computing) are returned, to compute once this worker's step is made: their
        values are that step's. Tasks of the iteration whose step it holds back are computed
        at once on the values this worker holds, those of clock `values_at` (only tasks of
        that clock, and of the next: a straggler a clock ahead of what this worker holds is
        no straggler of this step;
        at the end of backward, waiting for the step's mean, a reentrant autograd pass that
        leaves `.grad` alone). Returns (tasks to compute later, seconds held: waiting and helping).

        The one rule of how many: taking a task pays only where a straggler stays one (the
        tasks open to a helper are mostly the straggler's next iteration's, computed after
        this worker's own values land, delaying its own next batch by what it saves the
        straggler). Workers of one speed wait a moment for the last of them at each barrier,
        now and then long (a time slice lost), and trading tasks then costs a push and gains
        nothing. So: tasks only while the barriers hold this worker (waiting and helping)
        two tasks' time or more on average (a running mean: one long wait by chance is not a
        straggler), then one task per task-time of waiting."""
        loader = self._falcon_tasks
        w = self._falcon_worker
        later: list[tuple[int, int, range]] = []
        asks: list[tuple[int, int, bool]] = []
        t0 = time.perf_counter()
        helping = 0.0
        cost = loader._help_s or loader._task_s
        eager = loader._held_s is None or loader._held_s >= 2 * cost
        taken = 0
        while True:
            # What arrives after this count (the values, an offer) ends the sleep below: the
            # wait costs no CPU and ends as the values land.
            seen = w.news()
            if all(h.ready() for h in handles):
                break
            # The offer names the straggler's iteration not yet pushed: computing it, its
            # loader has opened the next one to helpers; between its push and its next
            # batch, the one it names is still open.
            asks.extend(
                a
                for s, c in w.offers()
                for a in ((s, c + 1, True), (s, c, False))
                if a[1] == values_at + (1 if a[2] else 0)
            )
            waited = time.perf_counter() - t0
            due = taken * cost  # the wait after which one more task pays
            if not eager or not asks or waited < due:
                w.wait_news(seen, min(max(due - waited, 0.0), 0.05) if asks and eager else 0.05)
                continue
            straggler, clock, ahead = asks[0]
            lo, hi = w.steal(straggler, clock, 1)
            if hi <= lo:
                asks.pop(0)  # nothing (more) to take there
                continue
            taken += hi - lo
            if ahead:
                later.append((straggler, clock, range(lo, hi)))
                continue
            helping += self._help_timed(straggler, clock, range(lo, hi))
        parked = time.perf_counter() - t0
        loader.stats["helping_s"] += helping
        loader.stats["blocked_s"] += parked - helping
        return later, parked

    def _help_timed(self, owner: int, clock: int, tasks: range) -> float:
        """`_falcon_help`, counted, its time per task kept for the pacing above; returns its
        seconds."""
        loader = self._falcon_tasks
        th = time.perf_counter()
        self._falcon_help(owner, clock, tasks)
        took = time.perf_counter() - th
        per = took / len(tasks)
        loader._help_s = per if loader._help_s == 0.0 else 0.8 * loader._help_s + 0.2 * per
        loader.stats["tasks_helped"] += len(tasks)
        return took

    def _falcon_help(self, owner: int, clock: int, task_ids) -> None:
        """Computes tasks `task_ids` of worker `owner`'s iteration `clock` on this worker's
        values and pushes each bucket's gradient (their share of the batch) for it."""
        loader = self._falcon_tasks
        idx = loader._indices(owner, clock, task_ids)
        if loader.ledger is not None:
            loader.ledger.extend((owner, clock, t) for t in task_ids)
        trainable = [
            (b, i, p) for b in self._falcon_buckets for i, p in enumerate(b.params) if p.requires_grad
        ]
        grads: list = [None] * len(trainable)
        if len(idx) > 0:
            batch = loader._batch(idx)
            self._falcon_helping = True
            # A straggler's examples must not move this replica's buffers (BatchNorm's
            # running statistics are this worker's own batches', as under DDP).
            model = self._falcon_model
            kept = [(t, t.detach().clone()) for t in model.buffers()] if model is not None else []
            try:
                with torch.enable_grad():
                    if self._falcon_compute is not None:
                        loss = self._falcon_compute(batch)
                    else:
                        x, y = batch
                        loss = self._falcon_loss_fn(self._falcon_model(x), y)
                    loss = loss * (len(idx) / loader.batch_size)
                    grads = torch.autograd.grad(
                        loss, [p for _, _, p in trainable], allow_unused=True
                    )
            finally:
                self._falcon_helping = False
                with torch.no_grad():
                    for t, v in kept:
                        t.copy_(v)
        flat = {b.name: torch.zeros_like(b.values) for b in self._falcon_buckets}
        with torch.no_grad():
            for (b, i, _), g in zip(trainable, grads):
                if g is not None:
                    off, n = b.slices[i]
                    flat[b.name][off : off + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
        w = self._falcon_worker
        for b in self._falcon_buckets:
            w.push_for(b.name, _view(flat[b.name]), owner, clock)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """As the optimizer's own: a bucket's gradients are zeroed in place (they stay views
        into it), or with `set_to_none=True` (PyTorch 2's default) every `.grad` is None
        until backward makes one (then copied into the bucket, one copy per gradient, as DDP
        copies into its buckets by default)."""
        if set_to_none is None:
            set_to_none = _ZERO_GRAD_TO_NONE
        if self._falcon_local and not self._falcon_sync:
            return super().zero_grad(set_to_none)
        for p in self._falcon_wide:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        for b in self._falcon_buckets:
            if b.rows:
                p = b.params[0]
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad = None if p.grad.is_sparse else p.grad.zero_()
                continue
            with torch.no_grad():
                b.grads.zero_()
            b.none = set_to_none
            for i, p in enumerate(b.params):
                if set_to_none:
                    # As PyTorch's: no gradient until backward makes one (copied into the
                    # bucket when its hook runs).
                    p.grad = None
                elif b.cast:
                    if p.grad is not None:
                        p.grad.detach_()
                        p.grad.zero_()
                elif p.grad is not None and p.grad is not b.gviews[i]:
                    p.grad = b.gviews[i]

    def synchronize(self) -> None:
        """Pushes what backward did not (parameters without a gradient push zeros, so
        every tensor moves one clock) and waits until the servers have every gradient. With
        each worker's own optimizer under a synchronous policy, backward's end has done so
        already (`.grad` holds the mean); under an asynchronous one step() does it all. As
        Horovod's: a `step()` that follows it without `skip_synchronize()` warns, and does not
        exchange the step again."""
        self._falcon_synced = True
        self._falcon_synchronize()

    def _falcon_synchronize(self) -> None:
        if self._falcon_local:
            if self._falcon_sync:
                self._falcon_average()
            return
        self.wait_pulls()
        for b in self._falcon_buckets:
            if not b.sent:
                if b.rows:
                    self._falcon_send_rows(b, b.params[0])
                else:
                    self._falcon_send(b)
        handles, self._falcon_handles = self._falcon_handles, {}
        _wait_all(handles.values())
        for b in self._falcon_buckets:
            if not b.rows:
                b.unfired_to_none()
            b.reset()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's: `step()` inside this block does not synchronize (the script called
        `synchronize()` itself, to clip the step's gradient first)."""
        self._falcon_skip = True
        try:
            yield
        finally:
            self._falcon_skip = False

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's: backward passes inside this block accumulate gradients on this worker
        without exchanging them; the first backward after it exchanges what accumulated (a
        gradient accumulation of a varying number of passes)."""
        if not (self._falcon_local and self._falcon_sync):
            raise _f.ConfigError(
                "no_sync() defers the exchange of gradients to the next backward: with each "
                "worker's own optimizer under a synchronous policy (the default); here use "
                "backward_passes_per_step=N"
            )
        self._falcon_no_sync = True
        try:
            yield
        finally:
            self._falcon_no_sync = False

    def step(self, closure: Callable[[], float] | None = None):
        """Waits for this step's pushes, then pulls the values the job's policy lets the
        next clock see into the parameters (the servers applied the update). With each
        worker's own optimizer (FALCON_OPTIMIZER=local): the optimizer's own step, on the
        mean gradient (synchronous policies) or on this worker's, whose change then goes to
        the servers (asynchronous ones)."""
        synced, self._falcon_synced = self._falcon_synced, False
        if synced and not self._falcon_skip:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(): the step is not exchanged again; wrap step() in "
                "`with optimizer.skip_synchronize():` after synchronize()",
                stacklevel=2,
            )
        self._falcon_check_views()
        # A scheduler made on the wrapped optimizer counts its steps there.
        base = self._falcon_base
        if base is not self and hasattr(base, "_step_count"):
            base._step_count += 1
        if self._falcon_local:
            loss = self._falcon_local_step(closure)
            self._falcon_sync_buffers()
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._falcon_check_grads()
        finally:
            # Refused or not, the step the servers make goes through, so the job stays in
            # step (the error says the change was not applied). After synchronize() the
            # servers have it: only the next clock's values are left to take.
            if not synced:
                self._falcon_synchronize()
            self._falcon_next_clock()
        self._falcon_sync_buffers()
        return loss

    def _falcon_check_views(self) -> None:
        """The parameters still lie in their buckets (a pull writes there): a model moved or
        parameters replaced after the optimizer was made would silently stop training."""
        for b in self._falcon_buckets:
            if b.params[0].data_ptr() != b.ptr:
                raise _f.ConfigError(
                    f"parameter {b.names[0]!r} no longer lies in its bucket: the model was "
                    f"moved (model.to(), .half()) or its parameters replaced after "
                    f"DistributedOptimizer was made; make the optimizer after moving the model"
                )

    @property
    def clock(self) -> int:
        """The clock of the next push: steps taken by this worker's job."""
        return self._falcon_clock

    @property
    def worker(self) -> "_f.Worker":
        """The falcon worker this optimizer pushes and pulls through."""
        return self._falcon_worker


_ZERO_GRAD_TO_NONE = inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
    "set_to_none"
].default


def _join(named, plan, worker, fp16: bool = False):
    """The worker and the plan to train with: a deferred `init()` joins with `plan`; a
    worker that declared the plan's tensors keeps it; one that declared a tensor per
    parameter trains them one by one. `fp16`: Compression.fp16, the float32 buckets travel
    as float16 too."""
    want = [(name, sum(named[i][1].numel() for i in idx)) for name, idx in plan]
    if worker is None and _f._worker is None:
        # 16-bit parameters' buckets travel as 16 bits.
        dtypes = {
            name: _DTYPES[named[idx[0]][1].dtype] or ("float16" if fp16 else None)
            for name, idx in plan
        }
        return _f.declare(want, {n: d for n, d in dtypes.items() if d is not None}), plan
    if fp16:
        raise _f.ConfigError(
            "compression=Compression.fp16 declares the job's tensors as 16 bits: let the "
            "optimizer declare them (falcon.init() without tensors), or start the job with "
            "FALCON_WIRE=f16"
        )
    w = worker if worker is not None else _f._worker
    declared = dict(w.tensors)
    if all(declared.get(n) == k for n, k in want):
        return w, plan
    if all(n in declared for n, _ in named):
        for n, p in named:
            if declared[n] != p.numel():
                raise _f.LengthError(
                    f"parameter {n!r} has {p.numel()} values; the job's tensor has {declared[n]}"
                )
        return w, [(n, [i]) for i, (n, _) in enumerate(named)]
    missing = next((n for n, _ in want if n not in declared), None)
    if missing is None:
        n, k = next((n, k) for n, k in want if declared.get(n) != k)
        raise _f.LengthError(f"tensor {n!r} has {k} values here; the job's has {declared[n]}")
    raise _f.TensorError(
        f"{missing!r} is not a tensor of this job (it has {sorted(declared)}): declare "
        f"falcon.torch.job_tensors(optimizer, model.named_parameters()) (buckets of "
        f"parameters), or one tensor per parameter"
    )


def _broadcast_buckets(buckets, w, exact=()) -> None:
    """Rank 0's values become the servers' initial values, and every worker pulls them (a
    rejoining worker takes the running job's). `exact`: buckets whose pulls would round the
    values (16 bits on the wire for float32 parameters the workers hold): rank 0's values
    reach the others through the workers' group instead, bit for bit."""
    if w.rejoined:
        for b in buckets:
            w.pull(b.name, _view(b.values), w.clock_of(b.name))
        return
    if w.rank == 0:
        for b in buckets:
            w.init_tensor(b.name, _view(b.values))
    w.barrier()
    exact_ids = {id(b) for b in exact}
    _wait_all([w.pull_async(b.name, _view(b.values), w.clock_of(b.name)) for b in buckets if id(b) not in exact_ids])
    if exact and w.workers > 1:
        _bcast(_group(w), [b.values for b in exact], 0)
    for b in buckets:
        if b.cast:
            b.to_params(b.values)
    # Nobody pushes before everyone has the values (an asynchronous policy would let the
    # root's first update into a slower worker's start).
    w.barrier()


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    policy: str | None = None,
    *,
    backward_passes_per_step: int = 1,
    worker=None,
    model: torch.nn.Module | None = None,
    bucket_bytes: int | None = None,
    tasks: "TaskLoader | None" = None,
    loss_fn: Callable | None = None,
    compute: Callable | None = None,
    broadcast_buffers: bool = True,
    compression: "type[Compression] | None" = None,
    sparse_as_dense: bool = False,
):
    """Wraps `optimizer` for training on a falcon job, in the manner of Horovod's and
    BytePS's `DistributedOptimizer`.

    The parameters travel in buckets of about `bucket_bytes` (default `BUCKET_BYTES`, or
    FALCON_BUCKET_BYTES), each a tensor of the job (`job_tensors` lists them; a deferred
    `falcon.init()` joins here with them): as DDP's, a bucket holds parameters of one group
    in reverse order and leaves as soon as backward has made all its gradients, in one
    push-pull. The parameters become views into their bucket's values, and their `.grad`
    views into its gradients (DDP's gradient_as_bucket_view): one pull writes them all. With
    `bucket_bytes=0`, or a worker that declared one tensor per parameter, each parameter is
    its own tensor. The servers start from rank 0's values, which every worker pulls before
    this returns.

    How the optimizer applies (`optimizer_settings`): where the servers apply it (SGD,
    momentum, Adam, AdamW, Adagrad), each gradient is pushed with weight decay added (AdamW's
    is the servers'), asking for its parameter group's current learning rate (any schedule)
    and decay as multiples of the job's; `step()` waits for the pushes and pulls the values
    the job's policy allows; a change made to `.grad` after backward, or state in the
    optimizer, cannot reach them and is a ConfigError at `step()`. By default (no
    FALCON_OPTIMIZER: `local`) each worker applies its own optimizer, whatever it is: under a synchronous policy backward ends with `.grad` holding
    the mean of every worker's gradient, so clipping, a gradient scaler and any optimizer
    and schedule run as in one process; under an asynchronous one `step()` pushes the change
    this worker's optimizer made. `policy`, when given, must be the job's (it is checked).

    With `model` (the module whose parameters these are), `step()` returns as soon as the
    pulls are issued, in the order the forward pass first uses the buckets, and each
    module's forward waits only for its own parameters' buckets: the next forward overlaps
    the pulls still arriving. A parameter read outside its own module's forward (a weight
    used functionally by a parent) must not be: leave `model` out then, or call
    `wait_pulls()` first. `wait_pulls()` also precedes evaluation or saving outside forward.
    `model` also finds sparse embeddings (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag`):
    under server-side SGD or Adagrad each is a tensor of its own whose gradient travels as
    the rows it touches, and its forward pulls the rows its input uses.

    With `tasks` (a `TaskLoader` the loop iterates) falcon's task transfer works in the user's
    own loop: each batch the loader yields is this worker's share of its iteration, and while
    the policy holds this worker back (waiting for the next batch) it computes a straggler's
    unstarted tasks — with `model` and `loss_fn` (`loss_fn(model(inputs), targets)`, a mean
    over its examples) or `compute` (a callable taking a batch, returning its mean loss) — and
    pushes their gradient credited to the straggler.

    Buffers (BatchNorm's running statistics and any registered buffer) are rank 0's on every
    worker from the wrapping on (with `model`) and after every step, as DDP's
    `broadcast_buffers=True`; without `model`, those of the modules owning these parameters,
    found in the first forward pass. `broadcast_buffers=False` leaves each worker its own.
    They travel in the workers' own gloo group (under torchrun at its store, else at the
    scheduler's host, the port after its own, hosted by worker 0).

    `compression=Compression.fp16` (Horovod's) sends each gradient and the step's mean as
    float16 (each worker's own optimizer under a synchronous policy); `sparse_as_dense=True`
    makes a sparse embedding's gradient dense. A parameter named twice, or one the optimizer
    trains left unnamed, is a ValueError (a ConfigError too).

    The result is an instance of `optimizer`'s class (schedulers accept it) that trains the
    same parameter groups. `model.named_parameters()` is the input, not a state_dict (whose
    tensors are copies)."""
    if isinstance(optimizer, _Distributed):
        raise _f.ConfigError("this optimizer is already a falcon DistributedOptimizer")
    if named_parameters is None:
        named = [
            (f"param.{i}.{j}", p)
            for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])
        ]
    else:
        named = _named(named_parameters)
    base = optimizer.__class__
    cls = type(
        base.__name__,
        (_Distributed, base),
        {"__doc__": f"{base.__name__} on a falcon job (falcon.torch.DistributedOptimizer)."},
    )
    # The wrapped optimizer's groups (hyperparameters included); its state stays unused: the
    # servers hold the job's.
    new = cls.__new__(cls)
    try:
        base.__init__(new, optimizer.param_groups, **optimizer.defaults)
    except TypeError:  # a class whose defaults are not all constructor arguments
        base.__init__(new, optimizer.param_groups)
    new._falcon_base = optimizer
    # State loaded before wrapping (a resumed checkpoint: `opt.load_state_dict(...)`, then
    # wrap) is kept: the parameters are the same tensors, so the state's keys still hold.
    for p, st in optimizer.state.items():
        if st:
            new.state[p] = st
    new._falcon_setup(
        named, policy, worker, backward_passes_per_step, model, bucket_bytes, tasks, loss_fn,
        compute, broadcast_buffers, compression, sparse_as_dense,
    )
    if tasks is not None:
        tasks._attach(new)
    return new


class TaskLoader:
    """The batches of this worker's iterations, as a `DistributedSampler`'s loader gives them,
    cut into tasks that other workers can take over (falcon's task transfer in the user's own
    loop).

    Iteration `c` of worker `w` is `batch_size` examples of the job's shuffled stream (each
    epoch a permutation drawn from `seed`, the same on every worker: `task_examples`), cut into
    `tasks` tasks. Iterating yields, for each iteration, the examples of the tasks still this
    worker's — (inputs, targets) for tensor data, `collate_fn`'s batch for a dataset. Pass the
    loader to `DistributedOptimizer(..., tasks=loader, model=model, loss_fn=loss_fn)`: when a
    batch is yielded, the next iteration's tasks open to helpers; a worker the policy holds
    back (EPSP's) takes some of a straggler's, computes them on its own values and pushes
    their gradient credited to the straggler; what the straggler's loader yields next is the
    rest (at least one task), and its gradient counts as that share of the batch. Every task
    is processed exactly once, on the values its step sees: a helper takes tasks of the
    straggler's next iteration while it waits and computes them once its own values for that
    iteration have landed, so each step is BSP's mean over every worker's batch (a helper's
    push that reaches the servers after the straggler's own joins the next step).

    `for batch in loader` runs `iterations` iterations (default: one epoch, the examples
    divided by `batch_size` × workers), continuing from the optimizer's clock; after the loop
    the parameters hold the last step's values. Each iteration is reported to the
    scheduler's parallelism manager, whose advice sets `torch.set_num_threads`. `stats` counts
    own, given and helped tasks and the seconds spent helping and blocked; with
    `ledger=True`, `ledger` lists every (owner, clock, task) processed here."""

    def __init__(
        self,
        data,
        batch_size: int,
        *,
        tasks: int = 4,
        seed: int = 1,
        iterations: int | None = None,
        collate_fn: Callable | None = None,
        transfer: bool = True,
        ledger: bool = False,
    ):
        if batch_size < 1 or tasks < 1 or tasks > batch_size:
            raise _f.ConfigError(
                f"batch_size ≥ 1 and 1 ≤ tasks ≤ batch_size; got batch_size={batch_size}, "
                f"tasks={tasks}"
            )
        if iterations is not None and iterations < 0:
            raise _f.ConfigError(f"iterations must be ≥ 0, not {iterations}")
        self._data = _Data(data)
        self._orders = _Orders(self._data.n, seed)
        self.batch_size, self.tasks, self.seed = batch_size, tasks, seed
        self.iterations = iterations
        self._collate = collate_fn
        self._transfer = transfer
        self._opt = None
        self._source = _f.Tasks()
        self._open: int | None = None  # the iteration whose tasks the source holds
        self._last: int | None = None  # the last iteration yielded
        # Seconds one own task takes (a running mean; none known yet: 0, helping at once).
        self._task_s = 0.0
        self._help_s = 0.0  # seconds one helped task takes, pushed (a running mean)
        # What a barrier held this worker (waiting and helping), a running mean: none yet.
        self._held_s: float | None = None
        self.ledger: list | None = [] if ledger else None
        self.stats = {
            "iterations": 0, "tasks_own": 0, "tasks_given": 0, "tasks_helped": 0,
            "helping_s": 0.0, "blocked_s": 0.0, "threads": torch.get_num_threads(),
        }

    def _attach(self, opt) -> None:
        w = opt._falcon_worker
        if self.batch_size * w.workers > self._data.n * 1000:
            raise _f.ConfigError(
                f"a batch of {self.batch_size} on {w.workers} workers is beyond "
                f"{self._data.n} examples"
            )
        # Each worker applying its own optimizer under an asynchronous policy pushes the
        # change its optimizer made, to which a helper's gradient cannot add: the loader then
        # only deals the batches. Under a synchronous one a worker waiting for the step's
        # mean takes a straggler's next tasks and computes them after its step.
        if opt._falcon_local and not opt._falcon_sync:
            self._transfer = False
        self._opt = opt
        if self._transfer:
            w.serve_steals(self._source, keep=1)

    def __len__(self) -> int:
        if self.iterations is not None:
            return self.iterations
        if self._opt is None:
            raise _f.ConfigError(
                "a TaskLoader's length depends on the job's workers: pass it to "
                "DistributedOptimizer(..., tasks=loader) first, or give iterations="
            )
        return max(1, self._data.n // (self.batch_size * self._opt._falcon_worker.workers))

    def _indices(self, owner: int, clock: int, task_ids) -> torch.Tensor:
        w = self._opt._falcon_worker
        return _examples_of(
            self._orders, w.workers, self.batch_size, self.tasks, owner, clock, task_ids
        )

    def _batch(self, idx: torch.Tensor):
        if self._collate is not None and self._data.ds is not None:
            return self._collate([self._data.ds[int(i)] for i in idx])
        return self._data.batch(idx)

    def _open_for(self, clock: int) -> None:
        """Opens iteration `clock`'s tasks to this worker and its helpers."""
        if self._open != clock:
            self._source.reset(clock, self.tasks)
            self._open = clock

    def __iter__(self):
        opt = self._opt
        if opt is None:
            raise _f.ConfigError(
                "pass this TaskLoader to DistributedOptimizer(..., tasks=loader) before "
                "iterating it: its iterations are the optimizer's clocks"
            )
        w = opt._falcon_worker
        n = len(self)
        yielded_at, own = None, 0
        threads = torch.get_num_threads()
        for k in range(n):
            if yielded_at is not None:
                self._report(w, threads, own, time.perf_counter() - yielded_at)
                threads = torch.get_num_threads()
            opt._falcon_help_wait()
            c = opt.clock
            if c == self._last:
                raise _f.ClockError(
                    f"iteration {c} of this TaskLoader again: call opt.step() once per batch "
                    f"(a batch is one step of the job)"
                )
            self._last = c
            self._open_for(c)
            claimed = []
            while True:
                t = self._source.claim()
                if t is None:
                    break
                claimed.append(t)
            # The next iteration's tasks open to helpers while this one is computed (not past
            # this loop's last: a later loop opens its own first one).
            if k + 1 < n and self._transfer:
                self._open_for(c + 1)
            own = len(claimed)
            if self.ledger is not None:
                self.ledger.extend((w.rank, c, t) for t in claimed)
            idx = self._indices(w.rank, c, claimed)
            opt._falcon_share = len(idx) / self.batch_size
            self.stats["iterations"] += 1
            self.stats["tasks_own"] += own
            self.stats["tasks_given"] += self.tasks - own
            yielded_at = time.perf_counter()
            yield self._batch(idx)
        if yielded_at is not None:
            self._report(w, threads, own, time.perf_counter() - yielded_at)
        # The last step's values in the parameters; a step outside the loader is a whole
        # batch.
        opt._falcon_help_wait()
        opt._falcon_share = 1.0

    def _report(self, w, threads: int, own: int, seconds: float) -> None:
        """The iteration's compute to the parallelism manager; its advice for the next."""
        w.report_iteration(threads, own, seconds)
        if own > 0:
            per = seconds / own
            self._task_s = per if self._task_s == 0.0 else 0.8 * self._task_s + 0.2 * per
        self.stats["threads"] = _take_advice(w)


def _usable_cpus() -> int:
    """The CPUs this process can use at once: those it may run on, fewer where its control
    group's CPU quota allows less (a worker held to half a CPU gains nothing from a second
    thread, and its arithmetic changes with the thread count). Read again at most once a
    second (a loop asks at every iteration; reading the control group's files each time costs
    a worker on a small quota more than a per cent of its share)."""
    now = time.monotonic()
    if _USABLE[0] is not None and now - _USABLE[1] < 1.0:
        return _USABLE[0]
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _f._falcon.own_cpus()
    if quota is not None:
        cpus = min(cpus, int(quota))
    _USABLE[:] = [max(1, cpus), now]
    return _USABLE[0]


_USABLE: list = [None, 0.0]
"""The last answer of `_usable_cpus` and when it was read."""


def _take_advice(w) -> int:
    """Applies the parallelism manager's thread-count advice, if any (capped at the CPUs this
    process can use); returns the thread count now."""
    advice = w.advised_threads()
    if advice is not None:
        advice = max(1, min(int(advice), _usable_cpus()))
        if advice != torch.get_num_threads():
            torch.set_num_threads(advice)
    return torch.get_num_threads()


# --- the task-driven trainer ---------------------------------------------------------------


class _Data:
    """The user's data as (inputs, targets) batches by index."""

    def __init__(self, data):
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(
            isinstance(t, torch.Tensor) for t in data
        ):
            x, y = data
            if len(x) != len(y):
                raise _f.ConfigError(f"the inputs have {len(x)} examples, the targets {len(y)}")
            self.x, self.y, self.ds = x, y, None
            self.n = len(x)
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.x = self.y = None
            self.ds = data
            self.n = len(data)
        else:
            raise _f.ConfigError(
                "data must be (inputs, targets) tensors or a dataset with __len__ and "
                "__getitem__ (a torch.utils.data.Dataset)"
            )
        if self.n == 0:
            raise _f.ConfigError("the data has no examples")

    def batch(self, idx: torch.Tensor):
        if self.ds is None:
            return self.x[idx], self.y[idx]
        from torch.utils.data import default_collate

        return default_collate([self.ds[int(i)] for i in idx])


class _Orders:
    """The shuffled order of each epoch, from the job's seed (the same on every worker)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.cache = n, seed, {}

    def of(self, epoch: int) -> torch.Tensor:
        o = self.cache.get(epoch)
        if o is None:
            if len(self.cache) > 8:
                self.cache.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            o = self.cache[epoch] = torch.randperm(self.n, generator=g)
        return o


def task_examples(
    n: int, workers: int, batch: int, tasks: int, seed: int, worker: int, clock: int, task: int
) -> torch.Tensor:
    """The example indices of task `task` of worker `worker`'s iteration `clock`: a range of
    the job's shuffled stream of examples (each epoch a permutation drawn from `seed`), so
    any worker can compute any other's task."""
    orders = _ORDERS.get((n, seed))
    if orders is None:
        if len(_ORDERS) > 8:
            _ORDERS.clear()
        orders = _ORDERS[(n, seed)] = _Orders(n, seed)
    # A copy: the slice is the cached order's own memory, which later tasks read.
    return _task_examples(orders, workers, batch, tasks, worker, clock, task).clone()


_ORDERS: dict = {}
"""The epochs' orders `task_examples` drew, by (examples, seed): a loop calling it for every
task does not draw a permutation each time."""


def _task_examples(orders: _Orders, workers, batch, tasks, worker, clock, task) -> torch.Tensor:
    return _tasks_examples(orders, workers, batch, tasks, worker, clock, task, task + 1)


def _examples_of(orders: _Orders, workers, batch, tasks, owner, clock, task_ids) -> torch.Tensor:
    """The examples of tasks `task_ids` of `owner`'s iteration `clock`, in the tasks' order;
    tasks next to each other are one range of the stream (one slice per run)."""
    runs: list[list[int]] = []
    for t in task_ids:
        if runs and runs[-1][1] == t:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1])
    parts = [_tasks_examples(orders, workers, batch, tasks, owner, clock, a, b) for a, b in runs]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def _tasks_examples(orders: _Orders, workers, batch, tasks, worker, clock, first, end) -> torch.Tensor:
    """The examples of tasks `first` … `end - 1` of an iteration: one range of the stream."""
    micro = math.ceil(batch / tasks)
    lo = min(first * micro, batch)
    hi = min(max(end, first) * micro, batch)
    start = (clock * workers + worker) * batch + lo
    parts = []
    pos, stop = start, start + (hi - lo)
    while pos < stop:
        epoch, off = divmod(pos, orders.n)
        take = min(stop - pos, orders.n - off)
        parts.append(orders.of(epoch)[off : off + take])
        pos += take
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class FitSummary(dict):
    """What `fit` returns, a dict: rank, iterations, secs, compute_s, blocked_s, helping_s,
    injected_s, tasks_own, tasks_helped, tasks_given, threads (per iteration), last_loss,
    snapshots ([(secs, iteration, flat float32 values)], rank 0 only), ledger ((owner,
    clock, task) processed here, when `ledger=True`)."""


def _flat(model) -> int:
    return sum(p.numel() for p in model.parameters())


def fit(
    model: torch.nn.Module,
    loss_fn: Callable,
    data,
    *,
    iterations: int,
    batch: int = 64,
    tasks: int = 4,
    seed: int = 1,
    transfer: bool = True,
    hetero: str | None = None,
    threads: int | None = None,
    snapshot_every: int = 0,
    ledger: bool = False,
    worker=None,
    tensor: str = "params",
) -> FitSummary:
    """Trains `model` on `data` for `iterations` iterations of this worker, falcon owning the
    iteration (the task-driven trainer, as capable as falcon's own).

    The model's parameters are one tensor of the job, `tensor` (a deferred `falcon.init()`
    joins here with it); the servers apply the job's optimizer (FALCON_OPTIMIZER,
    FALCON_LR) to the mean gradient of each iteration's `batch` examples. An iteration of
    worker w at clock c:

    1. Pull the values the policy lets clock c see. While the pull is parked (w would
       block), take task-transfer offers: ask the straggler for up to half of its iteration's
       unstarted tasks, compute them on w's current values and push their gradient credited
       to the straggler (`transfer=False` ignores offers).
    2. Compute this iteration's `tasks` tasks, each `batch / tasks` examples of the job's
       shuffled stream (`task_examples`), claimed from a source helpers take from too: a
       task is processed by exactly one worker. The parallelism manager's advice sets
       `torch.set_num_threads` and how many tasks are claimed and computed at once.
    3. Push the gradient, apply the heterogeneity (`hetero`: a spec such as "h=0.25" or
       "gauss(5,2)", or FALCON_HETERO's `RANK:SPEC;...` entries), report the iteration to
       the scheduler's supervisor.

    `loss_fn(outputs, targets)` returns the mean loss over its examples (PyTorch's default).
    `data` is (inputs, targets) tensors or a dataset with __len__ and __getitem__. Rank 0
    keeps a copy of its values every `snapshot_every` iterations (`evaluate` scores them
    after training, so that scoring never slows the job)."""
    if iterations < 0 or batch < 1 or tasks < 1 or tasks > batch:
        raise _f.ConfigError(
            f"iterations ≥ 0, batch ≥ 1 and 1 ≤ tasks ≤ batch; got iterations={iterations}, "
            f"batch={batch}, tasks={tasks}"
        )
    params = list(model.parameters())
    for name, p in model.named_parameters():
        _check_param(name, p)
    n = _flat(model)
    if worker is not None:
        w = worker
    elif _f._worker is not None:
        w = _f._worker
    else:
        w = _f.declare([(tensor, n)])
    declared = dict(w.tensors)
    if declared.get(tensor) != n:
        raise _f.LengthError(
            f"the model has {n} parameters; the job's tensor {tensor!r} has "
            f"{declared.get(tensor, 'no entry')}"
        )
    src = _Data(data)
    workers, rank = w.workers, w.rank
    if batch * workers > src.n * 1000:
        raise _f.ConfigError(f"a batch of {batch} on {workers} workers is beyond {src.n} examples")
    orders = _Orders(src.n, seed)
    spec = heterogeneity(hetero, workers, rank, seed)
    per_task = spec is not None and spec.per_task

    flat = np.zeros(n, np.float32)  # the pulled values
    grad = np.zeros(n, np.float32)
    help_grad = np.zeros(n, np.float32)
    flat_t = torch.from_numpy(flat)
    grad_t = torch.from_numpy(grad)

    def load(values: torch.Tensor):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(values, params)

    def accumulate(owner: int, clock: int, task_ids: Sequence[int], into: torch.Tensor):
        """Adds the gradient of these tasks (as a share of the batch) to `into`; returns
        (summed loss, examples)."""
        idx = _examples_of(orders, workers, batch, tasks, owner, clock, task_ids)
        if ledger:
            summary["ledger"].extend((owner, clock, t) for t in task_ids)
        if len(idx) == 0:
            return 0.0, 0
        x, y = src.batch(idx)
        for p in params:
            p.grad = None
        out = model(x)
        loss = loss_fn(out, y)
        (loss * (len(idx) / batch)).backward()
        with torch.no_grad():
            into.add_(
                torch.cat(
                    [
                        (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                        for p in params
                    ]
                )
            )
        return loss.item() * len(idx), len(idx)

    summary = FitSummary(
        rank=rank, iterations=0, secs=0.0, compute_s=0.0, blocked_s=0.0, helping_s=0.0,
        injected_s=0.0, tasks_own=0, tasks_helped=0, tasks_given=0, threads=[], last_loss=None,
        snapshots=[], ledger=[],
    )
    threads_now = threads or torch.get_num_threads()
    torch.set_num_threads(threads_now)
    source = _f.Tasks()
    w.serve_steals(source)
    # The servers start from rank 0's values; nobody pushes before everyone holds them.
    with torch.no_grad():
        flat_t.copy_(torch.nn.utils.parameters_to_vector(params))
    broadcast_parameters([(tensor, flat_t)], 0, w)
    model.train()
    start = time.perf_counter()
    first = w.clock_of(tensor)
    for c in range(first, iterations):
        # 1. Pull; help while the policy holds us.
        t0 = time.perf_counter()
        h = w.pull_async(tensor, flat, c)
        helping, nap = 0.0, 0.0002
        while not h.ready():
            helped = False
            if transfer and c > 0:
                for straggler, clock in w.offers():
                    lo, hi = w.steal(straggler, clock, (tasks + 1) // 2)
                    if hi <= lo:
                        continue
                    th = time.perf_counter()
                    help_grad.fill(0.0)
                    accumulate(straggler, clock, range(lo, hi), torch.from_numpy(help_grad))
                    w.push_for(tensor, help_grad, straggler, clock)
                    summary["tasks_helped"] += hi - lo
                    helping += time.perf_counter() - th
                    helped = True
            if helped:
                nap = 0.0002
            else:
                time.sleep(nap)
                nap = min(nap * 2, 0.005)
        h.wait()
        blocked = time.perf_counter() - t0 - helping
        summary["blocked_s"] += blocked
        summary["helping_s"] += helping
        load(flat_t)

        # 2. This iteration's tasks, claimed `threads_now` at a time.
        tc = time.perf_counter()
        source.reset(c, tasks)
        grad.fill(0.0)
        done, loss_sum, seen, slept = 0, 0.0, 0, 0.0
        while True:
            claimed = []
            while len(claimed) < threads_now:
                t = source.claim()
                if t is None:
                    break
                claimed.append(t)
            if not claimed:
                break
            tt = time.perf_counter()
            l, k = accumulate(rank, c, claimed, grad_t)
            loss_sum, seen = loss_sum + l, seen + k
            done += len(claimed)
            if per_task:
                d = spec.delay(c, time.perf_counter() - tt)
                if d > 0:
                    time.sleep(d)
                    slept += d
        compute = time.perf_counter() - tc
        summary["tasks_own"] += done
        summary["tasks_given"] += tasks - done
        if seen:
            summary["last_loss"] = loss_sum / seen

        # 3. Push, heterogeneity, parallelism.
        w.push(tensor, grad, c)
        if spec is not None and not per_task:
            slept = spec.delay(c, compute)
            if slept > 0:
                time.sleep(slept)
        summary["injected_s"] += slept
        summary["compute_s"] += compute - (slept if per_task else 0.0)
        summary["threads"].append(threads_now)
        summary["iterations"] = c + 1
        w.report_iteration(threads_now, done, compute if per_task else compute + slept)
        threads_now = _take_advice(w)
        if rank == 0 and snapshot_every > 0 and (c + 1) % snapshot_every == 0:
            # The values this iteration started from: `c` steps of this worker's clock.
            summary["snapshots"].append((time.perf_counter() - start, c, flat.copy()))
    # The last values, as the job has them.
    if iterations > first:
        w.pull(tensor, flat, iterations)
        load(flat_t)
        if rank == 0 and snapshot_every > 0:
            summary["snapshots"].append((time.perf_counter() - start, iterations, flat.copy()))
    summary["secs"] = time.perf_counter() - start
    if not ledger:
        del summary["ledger"]
    return summary


def heterogeneity(hetero: str | None, workers: int, rank: int, seed: int = 1):
    """Worker `rank`'s heterogeneity, as `fit` applies it: `hetero` (one spec for every
    worker, or `RANK:SPEC;...` entries), else FALCON_HETERO's, else none; a `falcon.Hetero`,
    or None for a worker at full speed."""
    text = hetero if hetero is not None else os.environ.get("FALCON_HETERO")
    if not text:
        return None
    if ":" in text:
        spec = _f.hetero_of(text, workers, rank, seed)
    else:
        spec = _f.Hetero(text, seed + rank)
    return None if spec.is_none else spec


def evaluate(model: torch.nn.Module, values, data, batch: int = 1000) -> float:
    """The accuracy of `model` with flat `values` (a snapshot of `fit`) on (inputs, targets)
    tensors; the model's own values are restored afterwards."""
    params = list(model.parameters())
    saved = torch.nn.utils.parameters_to_vector(params).detach().clone()
    x, y = data
    correct = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.as_tensor(values), params)
            for i in range(0, len(x), batch):
                correct += int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
    finally:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(saved, params)
        model.train(was_training)
    return correct / max(1, len(x))
