"""A worker process of the dtype parity test, and the test's reference: a bfloat16 BatchNorm
MLP trained with Adam, a float16 model trained with SGD and momentum, and a float64 BatchNorm
MLP trained with SGD and momentum (its gradients averaged in the workers' gloo group), through falcon
(each worker's own optimizer, the default, under BSP), printing one JSON line (`DTYPES
{...}`): each configuration's final parameters and buffers with their dtypes.

`reference()` is DDP's semantics written out in one process: each worker's gradient on its
slice of the global batch, their mean taken in float32 (float64 for float64 parameters) and
rounded once to the parameter's type, the optimizer's own step, and rank 0's buffers.

Arguments: RANK WORKERS CONFIGS_JSON (configuration → its job's environment)."""

import json
import sys

import torch
import torch.nn.functional as F

import falcon
import falcon.torch as ft

STEPS, BATCH = 20, 16
CONFIGS = ["bf16-adam", "f16-momentum", "f64-momentum"]


class Elementwise(torch.nn.Module):
    """float16 on a CPU: PyTorch 1.13 has no float16 matrix product there, so a model of
    elementwise products, with a 0-dimensional bias."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 10))
        self.b = torch.nn.Parameter(torch.tensor(0.25))

    def forward(self, x):
        return (x * self.w).sum(1) + self.b


def model_of(name):
    torch.manual_seed(3)
    if name != "f16-momentum":
        m = torch.nn.Sequential(
            torch.nn.Linear(10, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
            torch.nn.Linear(16, 3),
        )
        return m.to(torch.bfloat16 if name == "bf16-adam" else torch.float64)
    return Elementwise().to(torch.float16)


def opt_of(name, params):
    if name == "bf16-adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(512, 10, generator=g), torch.randint(0, 3, (512,), generator=g), torch.randn(512, generator=g)


def loss_of(name, model, x, y, t):
    if name != "f16-momentum":
        dtype = next(model.parameters()).dtype
        return F.cross_entropy(model(x.to(dtype)).float(), y)
    return ((model(x.half()).float() - t) ** 2).mean()


def slice_of(workers, rank, step):
    start = (step * BATCH * workers + rank * BATCH) % 512
    return slice(start, start + BATCH)


def state(model):
    return {k: [str(v.dtype), v.detach().double().reshape(-1).tolist()] for k, v in model.state_dict().items()}


def train(name, rank, workers, env):
    torch.set_num_threads(1)
    x, y, t = data()
    falcon.init(env={**env, "FALCON_ROLE": "worker", "FALCON_RANK": str(rank)})
    model = model_of(name)
    opt = ft.DistributedOptimizer(opt_of(name, model.parameters()), model.named_parameters())
    for step in range(STEPS):
        s = slice_of(workers, rank, step)
        opt.zero_grad()
        loss_of(name, model, x[s], y[s], t[s]).backward()
        opt.step()
    falcon.finish()
    return state(model)


def reference(name, workers):
    torch.set_num_threads(1)
    x, y, t = data()
    model = model_of(name)
    opt = opt_of(name, model.parameters())
    params = list(model.parameters())
    for step in range(STEPS):
        grads = [torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32) for p in params]
        # Rank 0 last: its batch's statistics are the buffers every replica keeps.
        for r in reversed(range(workers)):
            kept = [b.clone() for b in model.buffers()]
            s = slice_of(workers, r, step)
            opt.zero_grad()
            loss_of(name, model, x[s], y[s], t[s]).backward()
            for g, p in zip(grads, params):
                g.add_(p.grad.to(g.dtype))
            if r != 0:
                with torch.no_grad():
                    for b, k in zip(model.buffers(), kept):
                        b.copy_(k)
        for g, p in zip(grads, params):
            p.grad = (g / workers).to(p.dtype)
        opt.step()
    return state(model)


def main() -> None:
    rank, workers, configs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    print("DTYPES " + json.dumps({n: train(n, rank, workers, configs[n]) for n in CONFIGS}), flush=True)


if __name__ == "__main__":
    main()
