"""CUDA tensors through DLPack: pushed and pulled in place on the device (one DMA copy each
way), in the order of the stream that made them, and DistributedOptimizer on a model on the
GPU step for step against plain PyTorch there. The device tests are skipped, visibly, where
torch sees no CUDA device; the refusals that need no GPU run everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import falcon
import falcon.torch as ft

F = torch.nn.functional

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False); these run on a GPU machine",
)


class ClaimsDevice:
    """A DLPack producer whose memory claims to be on device type `kind` (2: CUDA), and
    whose export is not a capsule."""

    def __init__(self, kind: int):
        self.kind = kind

    def __dlpack_device__(self):
        return (self.kind, 0)

    def __dlpack__(self, stream=None):
        return "not a capsule"


def test_a_device_buffer_without_cuda_is_a_typed_error_and_loses_nothing(bsp1):
    w = bsp1
    if torch.cuda.is_available():
        # The driver opens; the producer's export is what is wrong.
        with pytest.raises(falcon.LengthError, match="capsule"):
            w.push("w", ClaimsDevice(2), 0)
    else:
        with pytest.raises(falcon.CudaError, match="CUDA: (libcuda not found|the CUDA driver)"):
            w.push("w", ClaimsDevice(2), 0)
        with pytest.raises(falcon.CudaError):
            w.pull("w", ClaimsDevice(2), 0)
    with pytest.raises(falcon.ConfigError, match="DLPack device type 8"):
        w.push("w", ClaimsDevice(8), 0)
    # Nothing was sent, nothing lost: clock 0 is still the next push.
    w.push("w", np.ones(4, np.float32), 0)
    v = np.zeros(4, np.float32)
    w.pull("w", v, 1)
    np.testing.assert_array_equal(v, np.full(4, -0.5, np.float32))


@needs_gpu
def test_cuda_tensors_are_pushed_and_pulled_in_place(bsp1):
    w = bsp1
    values = torch.zeros(4, device="cuda", requires_grad=True)  # a parameter-like tensor
    w.push("w", torch.ones(4, device="cuda"), 0)
    w.pull("w", values, 1)  # written in place on the device
    assert values.is_cuda
    torch.testing.assert_close(values.detach().cpu(), torch.full((4,), -0.5))
    # Asynchronous forms; a host buffer pulls the same bits.
    w.push_async("w", torch.arange(1, 5, device="cuda", dtype=torch.float32), 1).wait()
    h = w.pull_async("w", values, 2)
    h.wait()
    host = np.zeros(4, np.float32)
    w.pull("w", host, 2)
    np.testing.assert_array_equal(values.detach().cpu().numpy(), host)
    np.testing.assert_allclose(host, -0.5 - 0.5 * np.arange(1, 5), rtol=1e-6)
    # Refusals: type, layout, length; nothing is lost.
    with pytest.raises(falcon.TensorError, match="float32"):
        w.push("w", torch.ones(4, device="cuda", dtype=torch.float64), 2)
    with pytest.raises(falcon.TensorError, match="contiguous"):
        w.push("w", torch.ones(4, 2, device="cuda").t()[0], 2)
    with pytest.raises(falcon.LengthError, match="has 4 floats"):
        w.push("w", torch.ones(5, device="cuda"), 2)
    with pytest.raises(falcon.LengthError, match="has 4 floats"):
        w.pull("w", torch.ones(5, device="cuda"), 2)
    w.push("w", torch.zeros(4, device="cuda"), 2)
    assert w.clock_of("w") == 3


@needs_gpu
def test_a_push_reads_the_gradient_its_stream_made():
    """The gradient is written by kernels on a side stream still running when push is
    called: the export orders the copy after them (no host synchronisation by the test)."""
    n = 1 << 22
    c = falcon.local_cluster(workers=1, policy="bsp", lr=1.0)
    w = falcon.init({"g": n}, env=c.env)
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(side):
        g = torch.zeros(n, device="cuda")
        for _ in range(20):  # queue enough work that the copy would overtake it if unordered
            a = a @ a / 2048.0
        g.add_(a.flatten().abs().sum() * 0 + 3.0)
        w.push("g", g, 0)
        out = torch.empty(n, device="cuda")
        w.pull("g", out, 1)
        torch.testing.assert_close(out, torch.full((n,), -3.0, device="cuda"))
    falcon.finish()
    c.finish()


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@needs_gpu
@pytest.mark.parametrize(
    "make",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.01)],
    ids=["momentum", "adam"],
)
def test_distributed_optimizer_on_the_gpu_matches_plain_pytorch(make):
    model, ref = small_model().cuda(), small_model().cuda()
    opt, ropt = make(model.parameters()), make(ref.parameters())
    s = ft.optimizer_settings(opt)
    c = falcon.local_cluster(workers=1, policy="bsp", optimizer=s["FALCON_OPTIMIZER"], lr=s["FALCON_LR"])
    falcon.init(env=c.env)
    dopt = ft.DistributedOptimizer(opt, model.named_parameters(), policy="bsp")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 10, generator=g).cuda(), torch.randint(0, 3, (32,), generator=g).cuda()
    for step in range(25):
        for m, o in ((model, dopt), (ref, ropt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert a.is_cuda
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{n} at step {step}")
    assert dopt.clock == 25
    falcon.finish()
    c.finish()


@needs_gpu
def test_fp16_autocast_and_a_grad_scaler_follow_one_process_on_the_gpu():
    # Each worker's own AdamW (FALCON_OPTIMIZER=local): the scaler unscales the mean gradient
    # in the bucket's views, clipping and the step run as in one process; the buckets live
    # on the device (one export and one copy per bucket).
    model, ref = small_model().cuda(), small_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    c = falcon.local_cluster(workers=1, policy="bsp", optimizer="local", lr=1)
    falcon.init(env=c.env)
    dopt = ft.DistributedOptimizer(opt, model.named_parameters())
    assert len(dopt.buckets) == 1 and model[0].weight.grad is None
    scalers = {id(dopt): torch.cuda.amp.GradScaler(), id(ropt): torch.cuda.amp.GradScaler()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 10, generator=g).cuda(), torch.randint(0, 3, (32,), generator=g).cuda()
    for step in range(15):
        for m, o in ((model, dopt), (ref, ropt)):
            scaler = scalers[id(o)]
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(o)
            scaler.update()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert a.is_cuda and a.grad.is_cuda
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=n)
    falcon.finish()
    c.finish()
