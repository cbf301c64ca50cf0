"""Horovod's PyTorch tests (test/parallel/test_torch.py), the cases that apply to a parameter
server, rewritten against falcon: `hvd` below maps Horovod's names onto falcon's. Each case
keeps Horovod's checks; where falcon differs on purpose the case says so and checks
falcon's behaviour instead. A worker process runs every case, each in a job of its own, and
prints one line per case: `HOROVOD <case> ok` or `HOROVOD <case> FAILED <why>`.

Arguments: RANK WORKERS ENVS_JSON (case → the environments of its jobs, in order: a case
that calls init() again after shutdown() takes the next)."""

import inspect
import itertools
import json
import os
import sys
import tempfile
import traceback
import unittest
import warnings
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import falcon
import falcon.torch as ft


class _Hvd:
    """Horovod's module, as falcon provides it."""

    def __init__(self, rank):
        self.envs: list = []
        self._rank = rank
        self.Compression = ft.Compression
        self.DistributedOptimizer = ft.DistributedOptimizer
        self.broadcast_parameters = ft.broadcast_parameters
        self.broadcast_optimizer_state = ft.broadcast_optimizer_state
        self.is_initialized = falcon.is_initialized
        self.rank = falcon.rank
        self.size = falcon.size

    def init(self):
        if falcon.is_initialized():
            return  # Horovod's init() is idempotent too
        env = self.envs.pop(0)
        falcon.init(env={**env, "FALCON_ROLE": "worker", "FALCON_RANK": str(self._rank)})

    def shutdown(self):
        if not falcon.is_initialized():
            return
        try:
            if falcon._worker is None:
                # A case that never wrapped an optimizer: the job still needs its workers.
                falcon.declare([("hvd:unused", 1)])
        finally:
            falcon.finish()

    def broadcast(self, tensor, root_rank, name=None):
        return ft.broadcast(tensor, root_rank)

    def broadcast_(self, tensor, root_rank, name=None):
        return ft.broadcast_(tensor, root_rank)

    def broadcast_object(self, obj, root_rank=0, name=None):
        return ft.broadcast_object(obj, root_rank)


RANK = int(sys.argv[1]) if __name__ == "__main__" else 0
hvd = _Hvd(RANK)

# Every optimizer of torch.optim but L-BFGS and SparseAdam, in an order every rank shares.
OPTIMIZERS = sorted(
    (
        (c.__name__, c)
        for c in torch.optim.Optimizer.__subclasses__()
        if c.__module__.startswith("torch.optim") and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)
    ),
    key=lambda t: t[0],
)


def _kwargs_of(cls, params):
    return {k: v for k, v in params.items() if k in inspect.signature(cls.__init__).parameters}


def _mlp(d_in=100, h=10, d_out=10):
    return nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, d_out))


class Cases(unittest.TestCase):
    def test_horovod_is_initialized(self):
        hvd.init()
        self.assertTrue(hvd.is_initialized())
        hvd.shutdown()
        self.assertFalse(hvd.is_initialized())
        hvd.init()

    def test_horovod_rank(self):
        hvd.init()
        self.assertEqual(hvd.rank(), int(os.environ["HOROVOD_RANK"]))

    def test_horovod_size(self):
        hvd.init()
        self.assertEqual(hvd.size(), int(os.environ["HOROVOD_SIZE"]))

    def test_horovod_broadcast(self):
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64, torch.float16]
        for dtype, dim, root in itertools.product(dtypes, [1, 2, 3], range(size)):
            mine = torch.ones([17] * dim).mul_(rank).to(dtype)
            theirs = torch.ones([17] * dim).mul_(root).to(dtype)
            got = hvd.broadcast(mine, root)
            if rank != root:
                self.assertFalse(bool((mine.float() == theirs.float()).any()), "broadcast modified its source")
            self.assertTrue(bool((got.float() == theirs.float()).all()), f"{dtype}, root {root}")

    def test_broadcast_state(self):
        hvd.init()
        torch.manual_seed(hvd.rank())
        x, y = torch.randn(64, 100).requires_grad_(), torch.randn(64, 10).requires_grad_()

        def create(cls, params):
            model = _mlp()
            opt = cls(model.parameters(), **_kwargs_of(cls, params))
            return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

        def model_values(model):
            return [(k, v.clone()) for k, v in sorted(model.state_dict().items())]

        def opt_values(opt):
            sd = opt.state_dict()
            out = []
            for group in sd["param_groups"]:
                for pid in group["params"]:
                    for k, v in sorted(sd["state"].get(pid, {}).items()):
                        out.append((k, v.clone() if torch.is_tensor(v) else v))
            return out

        for (_, cls), params in itertools.product(OPTIMIZERS, [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]):
            model, opt = create(cls, params)
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            before = model_values(model)
            for name, v in before:
                hvd.broadcast_(v, root_rank=0, name=name)
            states = []
            for name, v in opt_values(opt):
                if torch.is_tensor(v):
                    hvd.broadcast_(v, root_rank=0, name=name)
                else:
                    v = hvd.broadcast_object(v, name=name)
                states.append((name, v))
            with tempfile.TemporaryDirectory() as d:
                path = hvd.broadcast_object(os.path.join(d, "checkpoint.pt"))
                if hvd.rank() == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
                # A fresh model and optimizer under the same names; rank 0 alone loads.
                model, opt = create(cls, params)
                if hvd.rank() == 0:
                    saved = torch.load(path)
                    model.load_state_dict(saved["model"])
                    opt.load_state_dict(saved["optimizer"])
                hvd.broadcast_object(0)  # rank 0 has read it before the directory goes
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            for (n0, v0), (n1, v1) in zip(before, model_values(model)):
                self.assertEqual(n0, n1)
                self.assertEqual(type(v0), type(v1))
                self.assertTrue(bool((v0 == v1).all()), f"{cls.__name__}: {n0}")
            expected = hvd.broadcast_object(len(opt.state_dict()["state"].values()))
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            self.assertEqual(len(opt.state_dict()["state"].values()), expected)
            for (n0, v0), (n1, v1) in zip(states, opt_values(opt)):
                self.assertEqual(n0, n1)
                self.assertEqual(type(v0), type(v1))
                if torch.is_tensor(v0):
                    self.assertTrue(bool((v0 == v1).all()), f"{cls.__name__}: {n0}")
                else:
                    self.assertEqual(v0, v1)

    def test_broadcast_state_options(self):
        hvd.init()
        x, y = torch.randn(64, 100).requires_grad_(), torch.randn(64, 10).requires_grad_()
        params_0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4), step_sizes=(1e-5, 100))
        params_1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75), step_sizes=(1e-7, 5))
        for _, cls in OPTIMIZERS:
            model = _mlp()
            mine = _kwargs_of(cls, params_0 if hvd.rank() == 0 else params_1)
            opt = hvd.DistributedOptimizer(cls(model.parameters(), **mine), named_parameters=model.named_parameters())
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            for k, want in _kwargs_of(cls, params_0).items():
                got = opt.param_groups[0][k]
                wants, gots = (want, got) if isinstance(want, Iterable) else ([want], [got])
                for a, b in zip(gots, wants):
                    self.assertEqual(type(a), type(b), f"{cls.__name__}.{k}")
                    self.assertAlmostEqual(a, b, delta=1e-5)
            # The broadcast options still work as the optimizer's.
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()

    def test_broadcast_state_no_grad(self):
        class ModelNoGrad(nn.Module):
            def __init__(self, a, b):
                super().__init__()
                self.a = nn.Parameter(a.int(), requires_grad=False)
                self.b = nn.Parameter(b)

            def forward(self, x):
                return torch.index_select(self.b, 0, self.a.long()) * x

        hvd.init()
        torch.manual_seed(hvd.rank())
        model = ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
        opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        # Horovod's broadcast_optimizer_state makes state by a step on zero gradients (which
        # moves the parameters under weight decay); falcon's changes nothing, so no gradient
        # exists before a backward. Both: the integer parameter never has one, and every
        # worker holds rank 0's values.
        self.assertIsNone(opt.param_groups[0]["params"][0].grad)
        self.assertIsNone(opt.param_groups[0]["params"][1].grad)
        for t in (model.a, model.b):
            self.assertTrue(bool(torch.equal(t.detach(), hvd.broadcast(t.detach(), root_rank=0))))
        opt.zero_grad()
        model(torch.ones(2)).sum().backward()
        opt.step()
        grad = opt.param_groups[0]["params"][1].grad
        self.assertTrue(bool(torch.equal(grad, hvd.broadcast(grad, root_rank=0))))

    def test_broadcast_object(self):
        hvd.init()
        expected = {"hello": 123, 0: [1, 2]}
        obj = hvd.broadcast_object(expected if hvd.rank() == 0 else {}, root_rank=0)
        self.assertDictEqual(obj, expected)

    def test_compression_fp16(self):
        compression = hvd.Compression.fp16
        for dtype in [torch.float32, torch.float64]:
            t = torch.ones([5] * 3, dtype=dtype)
            c, ctx = compression.compress(t)
            self.assertEqual(c.dtype, torch.float16)
            d = compression.decompress(c, ctx)
            self.assertEqual(d.dtype, dtype)
            self.assertLess(np.linalg.norm(np.ones([5] * 3) - d.numpy()), 1e-8)
        for dtype in [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]:
            t = torch.ones([5] * 3, dtype=dtype)
            c, ctx = compression.compress(t)
            self.assertEqual(c.dtype, dtype)
            d = compression.decompress(c, ctx)
            self.assertEqual(d.dtype, dtype)
            if dtype != torch.int8:
                self.assertLess(np.linalg.norm(np.ones([5] * 3) - d.numpy()), 1e-8)

    def test_compression_fp16_trains(self):
        # Not in Horovod's file as such: its optimizer with compression=fp16, 2 workers.
        hvd.init()
        torch.manual_seed(0)
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
        start = [p.detach().clone() for p in model.parameters()]
        # Wrapping leaves the parameters exact (only gradients travel as 16 bits).
        self.assertTrue(all(bool(torch.equal(a, b.detach())) for a, b in zip(start, model.parameters())))
        x, y = torch.randn(8, 100), torch.randn(8, 10)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        for p in model.parameters():
            self.assertTrue(bool(torch.equal(p.detach(), hvd.broadcast(p.detach(), root_rank=0))))

    def test_force_allreduce(self):
        hvd.init()
        rank = hvd.rank()
        x, y = torch.randn(64, 100).requires_grad_(), torch.randn(64, 10).requires_grad_()

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(100, 10)
                self.fc2 = nn.Linear(10, 10)
                self.fc3 = nn.Linear(10, 10)

            def forward(self, x_):
                x_ = F.relu(self.fc1(x_))
                x1 = self.fc2(x_)
                return x1, self.fc3(F.relu(x1))

        for (_, cls), params in itertools.product(OPTIMIZERS, [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]):
            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(cls(model.parameters(), **_kwargs_of(cls, params)), named_parameters=model.named_parameters())
            y1, y2 = model(x)
            # Rank 0's loss reaches no gradient of fc3: its step still exchanges every one.
            loss = F.mse_loss(y1 if rank == 0 else y2, y, reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()

    def test_duplicate_names(self):
        net1, net2 = nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1)
        opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
        with self.assertRaises(ValueError):
            hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(net1.named_parameters(), net2.named_parameters()))

    def _synchronized_linear(self, x, weight=None):
        """Horovod's clipping cases: a Linear(1, 1) broadcast from rank 0 and wrapped, one
        backward of its MSE to ones, then synchronize()."""
        hvd.init()
        model = nn.Linear(1, 1)
        if weight is not None:
            model.weight = nn.Parameter(torch.zeros(1, 1) + weight)
            model.bias = nn.Parameter(torch.zeros(1))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
        loss = F.mse_loss(model(x.requires_grad_()), torch.ones(1, 1).requires_grad_())
        opt.zero_grad()
        loss.backward()
        opt.synchronize()
        return model, opt

    def test_gradient_clipping(self):
        model, opt = self._synchronized_linear(torch.ones(1, 1), weight=0.5)
        prior = model.weight.grad.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        self.assertGreater(abs(prior), abs(model.weight.grad.item()))
        with opt.skip_synchronize():
            opt.step()

    def test_synchronize_step_warning(self):
        model, opt = self._synchronized_linear(torch.zeros(1, 1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            opt.step()
        self.assertEqual(len(ws), 1)
        self.assertIn("optimizer.step() called without optimizer.skip_synchronize()", str(ws[0].message))

    def test_no_named_parameters(self):
        hvd.init()
        model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loss = model(torch.rand([1, 1, 1000, 1000])).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def test_missing_named_parameters(self):
        model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with self.assertRaises(ValueError):
            hvd.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[0:1])


CASES = sorted(n for n in dir(Cases) if n.startswith("test_"))
# Cases that call init() again after shutdown(): a second job each.
REINIT = {"test_horovod_is_initialized"}


def main() -> None:
    rank, configs = int(sys.argv[1]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    for name in CASES:
        hvd.envs = list(configs[name])
        result = unittest.TestResult()
        Cases(name).run(result)
        try:
            hvd.shutdown()
            # A job the case did not use (it never called init()) still needs its workers.
            while hvd.envs:
                hvd.init()
                hvd.shutdown()
        except falcon.Error as e:
            result.errors.append((name, f"shutdown: {e}"))
        bad = result.failures + result.errors
        if bad:
            why = bad[0][1].strip().splitlines()[-1]
            print(f"HOROVOD {name} FAILED {why}", flush=True)
            print(bad[0][1], file=sys.stderr, flush=True)
        else:
            print(f"HOROVOD {name} ok", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
