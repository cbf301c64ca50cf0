"""A worker of a job that one rank stops: every rank trains a tiny model step after step; rank
STOPPER (argv[1]) stops itself after 5 steps — `int`: SIGINT (Ctrl-C), `term`: SIGTERM,
`raise`: its script raises — and prints `STOPPING <time>`. Launched with RANK/WORLD_SIZE/
MASTER_* by the test, which times each rank's exit."""

import os
import signal
import sys
import time

import torch

import falcon
import falcon.torch as ft

how = sys.argv[1]
falcon.init()
rank = falcon.rank()
stopper = falcon.size() - 1
model = torch.nn.Linear(4, 2)
opt = ft.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              model.named_parameters())
x = torch.randn(8, 4)
for step in range(100000):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if rank == stopper and step == 5:
        print(f"STOPPING {time.time()}", flush=True)
        if how == "int":
            os.kill(os.getpid(), signal.SIGINT)
        elif how == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise ValueError("the user's own bug")
    time.sleep(0.01)
