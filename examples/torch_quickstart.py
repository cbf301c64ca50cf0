"""The PyTorch quick start: a plain training loop — AdamW, warm-up then cosine, gradient
clipping — through a falcon job. The same script runs on every rank; on one host:

    FALCON_POLICY=bsp \\
        torchrun --nproc_per_node 4 --redirects 1 --tee 1 examples/torch_quickstart.py

(`--redirects 1 --tee 1`: Debian's torchrun 1.13 under Python 3.11 fails on its defaults;
elsewhere they only prefix each line with its rank.)

Each of torchrun's 4 ranks is the falcon worker of its rank (rank 0 also hosts the job's
scheduler and server on threads): each trains on its own quarter of every batch, and
backward ends with the mean of the quarters' gradients in `.grad` (the default, no
FALCON_OPTIMIZER: each worker applies its own optimizer, the servers average), so all train
what one process would on the whole batch. Prints each worker's loss every 10 steps and
`DONE <final loss>`.
"""

import math

import torch
import torch.nn.functional as F

import falcon
import falcon.torch as ft

falcon.init()  # every rank a worker; rank 0 also hosts the scheduler and the server
rank, workers = falcon.rank(), falcon.size()

torch.manual_seed(0)  # the same start everywhere (rank 0's values are broadcast anyway)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
steps, warmup = 100, 10
sched = torch.optim.lr_scheduler.LambdaLR(
    opt,
    lambda s: (s + 1) / warmup
    if s < warmup
    else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))),
)
opt = ft.DistributedOptimizer(opt, model.named_parameters())

data = torch.Generator().manual_seed(1)
x = torch.randn(256, 20, generator=data)
y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
for step in range(steps):
    batch = torch.arange(step * 32, step * 32 + 32) % 256
    mine = batch[rank::workers]  # this worker's part of the global batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x[mine]), y[mine])
    loss.backward()  # ends with the mean gradient of every worker in .grad
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % 10 == 0:
        print(f"worker {rank} step {step} loss {loss.item():.4f}", flush=True)
print(f"DONE {F.cross_entropy(model(x), y).item():.4f}", flush=True)
falcon.finish()
