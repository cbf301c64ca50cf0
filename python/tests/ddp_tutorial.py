"""PyTorch's "Getting started with DDP" checkpoint demo, ported to falcon with the documented
changes only (falcon.init() in place of init_process_group, DistributedOptimizer in place of
DistributedDataParallel): rank 0 saves the model, the others load it after a barrier, a
DistributedSampler() with no arguments shares the data, and the script's own collectives
run in torch.distributed's default group. Prints `TUTORIAL {json}` on every rank.

Run under torchrun: torchrun --nproc_per_node N ddp_tutorial.py CHECKPOINT_PATH [mismatch]
(mismatch: the ranks' models differ in one shape, which every rank refuses)"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import falcon
import falcon.torch as ft


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


falcon.init()
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])

if "mismatch" in sys.argv:
    # Models that differ in a shape alone (the same lengths): refused on every rank.
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros((4, 6) if rank == 0 else (6, 4)))
    try:
        ft.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())
    except falcon.ConfigError as e:
        print(f"REFUSED {rank}: {e}", flush=True)
        falcon.finish()
        sys.exit(3)
    sys.exit(0)

torch.manual_seed(rank)  # different on every rank: the checkpoint makes them equal
model = ToyModel()
path = sys.argv[1]
if rank == 0:
    torch.save(model.state_dict(), path)
dist.barrier()
model.load_state_dict(torch.load(path, map_location="cpu"))

opt = ft.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                              model.named_parameters())
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(60, 10, generator=g), torch.randn(60, 5, generator=g))
sampler = DistributedSampler(data, shuffle=False)
loader = DataLoader(data, batch_size=4, sampler=sampler)
loss_fn = nn.MSELoss()
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()

# The script's own collective: the sum of every rank's number.
mine = torch.tensor([float(rank + 1)])
dist.all_reduce(mine)
print("TUTORIAL " + json.dumps({
    "rank": rank, "falcon_rank": falcon.rank(), "falcon_size": falcon.size(),
    "dist_rank": dist.get_rank(), "dist_size": dist.get_world_size(),
    "indices": list(sampler), "all_reduce": mine.item(),
    "params": [round(float(p.sum()), 6) for p in model.parameters()],
}), flush=True)
falcon.finish()
