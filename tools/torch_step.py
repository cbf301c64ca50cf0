"""Step time of the same models in PyTorch on the same GPU (compare with
`cargo run --release --features cuda -p falcon-trainer --example step_time`).

One step: forward, cross-entropy (summed), backward and an SGD update on a batch of 64
that goes up from the host every step, the loss read back (as falcon's step does).
Prints the median milliseconds per step, as a table and as JSON lines.
"""
import json
import statistics
import sys
import time

import torch
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
dev = torch.device("cuda")
torch.manual_seed(1)


def mlp():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
for name, make, shape in [("mlp:784-256-10", mlp, (64, 784)), ("cnn:8-16", cnn, (64, 1, 28, 28))]:
    model = make().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 / 64)
    x = torch.rand(shape)
    y = torch.randint(0, 10, (64,))
    times = []
    for i in range(steps + 10):
        t = time.perf_counter()
        xb, yb = x.to(dev), y.to(dev)
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(xb), yb, reduction="sum")
        loss.backward()
        opt.step()
        loss.item()
        if i >= 10:
            times.append((time.perf_counter() - t) * 1e3)
    ms = statistics.median(times)
    print(f"{name:<16} {'pytorch (eager)':<18} {ms:>9.3} ms/step")
    print(json.dumps({"model": name, "batch": 64, "path": "pytorch", "ms_per_step": round(ms, 4)}))
