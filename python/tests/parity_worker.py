"""A worker process of the DDP-parity suite: trains the same small BatchNorm model on the same
examples under each configuration, either through falcon (each worker's own optimizer, the
default) or through DistributedDataParallel over gloo, and prints one JSON line (`PARITY
{...}`): each configuration's final parameters and buffers.

Arguments: SIDE (falcon or ddp) RANK WORKERS CONFIGS_JSON. For falcon, CONFIGS_JSON maps each
configuration to its job's environment; for ddp, to the gloo address."""

import json
import sys
import time

import torch
import torch.nn.functional as F

import falcon
import falcon.torch as ft

STEPS, BATCH, TASKS = 30, 16, 4


class Custom(torch.optim.Optimizer):
    """An optimizer written in the test: sign descent with a decaying rate."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["k"] = st.get("k", 0) + 1
                p.add_(p.grad.sign(), alpha=-g["lr"] / st["k"] ** 0.5)


def make_opt(name, params):
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        "momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
        "nesterov": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
        "adam": lambda: torch.optim.Adam(params, lr=0.01),
        "adamw-clip-cosine": lambda: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=0.005),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=0.05),
        "custom": lambda: Custom(params, lr=0.01),
        "onecycle-epsp": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "resume": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "horovod-resume": lambda: torch.optim.Adam(params, lr=0.01),
    }[name]()


def model_of(name=""):
    """A BatchNorm MLP; under epsp a LayerNorm one (BatchNorm's statistics are the whole
    batch's, which task transfer splits: falcon refuses the two together)."""
    torch.manual_seed(3)
    norm = torch.nn.LayerNorm(16) if "epsp" in name else torch.nn.BatchNorm1d(16)
    # No bias before the norm: its true gradient is zero, and Adam would turn the rounding of
    # two sums taken in another order into whole steps (noise, not a difference).
    return torch.nn.Sequential(torch.nn.Linear(10, 16, bias=False), norm, torch.nn.ReLU(), torch.nn.Linear(16, 3))


def examples():
    g = torch.Generator().manual_seed(11)
    return torch.randn(512, 10, generator=g), torch.randint(0, 3, (512,), generator=g)


def batch_of(x, y, workers, rank, c):
    idx = torch.cat([ft.task_examples(len(x), workers, BATCH, TASKS, 5, rank, c, t) for t in range(TASKS)])
    return x[idx], y[idx]


def schedule(name, opt):
    if name == "adamw-clip-cosine":
        import math

        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / STEPS))
        )
    if name == "onecycle-epsp":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS, cycle_momentum=True)
    return None


def checkpoint(name):
    """The 'resume' configuration starts from a checkpoint of 3 steps of one process, loaded
    before wrapping (every rank loads it, as the DDP tutorial does)."""
    model = model_of()
    opt = make_opt(name, model.parameters())
    x, y = examples()
    for c in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x[c * 32 : (c + 1) * 32]), y[c * 32 : (c + 1) * 32]).backward()
        opt.step()
    return model.state_dict(), opt.state_dict()


def train(side, name, rank, workers, where):
    torch.set_num_threads(1)
    x, y = examples()
    model = model_of(name)
    # Horovod's order: only rank 0 loads the checkpoint, then broadcast_parameters(state_dict)
    # and broadcast_optimizer_state make it everyone's (DDP's side: every rank loads it).
    loads = name == "resume" or (name == "horovod-resume" and (side == "ddp" or rank == 0))
    if name == "horovod-resume" and not loads:
        torch.manual_seed(100 + rank)  # another model's values: rank 0's must win
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t.double()).to(t.dtype) if t.is_floating_point() else t + rank + 1)
    if loads:
        m_state, o_state = checkpoint(name)
        model.load_state_dict(m_state)
    opt = make_opt(name, model.parameters())
    if loads:
        opt.load_state_dict(o_state)
    loader = None
    if side == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=where, rank=rank, world_size=workers)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        falcon.init(env={**where, "FALCON_ROLE": "worker", "FALCON_RANK": str(rank)})
        if name == "horovod-resume":
            ft.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = ft.DistributedOptimizer(opt, model.named_parameters())
            ft.broadcast_optimizer_state(opt, root_rank=0)
        elif name == "onecycle-epsp":
            loader = ft.TaskLoader((x, y), BATCH, tasks=TASKS, seed=5, iterations=STEPS)
            opt = ft.DistributedOptimizer(
                opt, model.named_parameters(), model=model, tasks=loader, loss_fn=F.cross_entropy
            )
        else:
            # No model=: the buffers are found in the first forward.
            opt = ft.DistributedOptimizer(opt, model.named_parameters())
    sched = schedule(name, opt)

    def batches():
        if loader is not None:
            yield from loader
        else:
            for c in range(STEPS):
                yield batch_of(x, y, workers, rank, c)

    for xb, yb in batches():
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if name == "onecycle-epsp" and rank == workers - 1:
            time.sleep(0.03)  # a straggler: its tasks move to the others
        if name == "adamw-clip-cosine":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if sched is not None:
            sched.step()
    module = model.module if side == "ddp" else model
    out = {k: v.detach().double().reshape(-1).tolist() for k, v in module.state_dict().items()}
    moved = loader.stats["tasks_helped"] if loader is not None else 0
    if side == "ddp":
        torch.distributed.destroy_process_group()
    else:
        falcon.finish()
    return out, moved


def main() -> None:
    side, rank, workers, configs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    result = {}
    for name, where in configs.items():
        result[name] = train(side, name, rank, workers, where)
    print("PARITY " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
