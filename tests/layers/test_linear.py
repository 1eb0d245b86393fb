"""layers/linear.py: the few-rows GEMV equals F.linear up to the order of fp32 sums (under the
Triton interpreter on CPU, and on the GPU), and SmallLinear takes it only where it applies."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from adaspec.layers import linear as lin

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                 reason="interpreter path: triton installed, no CUDA")


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@interpreter
@pytest.mark.parametrize("M,N,K,bias", [(1, 37, 600, False), (3, 16, 512, True), (4, 9, 1030, True),
                                        (1, 1100, 520, True)])
def test_gemv_matches_f_linear(monkeypatch, M, N, K, bias):
    monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")
    x, w = rnd(M, K, seed=1).to(torch.bfloat16), (rnd(N, K, seed=2) / K ** 0.5).to(torch.bfloat16)
    b = rnd(N, seed=3).to(torch.bfloat16) if bias else None
    assert lin.gemv_applies(x, w)
    got = lin.gemv(x, w, b)
    want = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    # the interpreter truncates fp32 -> bf16 (see test_fused_ops); on the GPU it rounds
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@interpreter
def test_small_linear_takes_the_gemv_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")
    layer = lin.SmallLinear(64, 24, bias=False).to(torch.bfloat16)
    wide = lin.SmallLinear(64, lin.SMALL_N + 1, bias=False).to(torch.bfloat16)
    calls = []
    real = lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        layer(rnd(2, 64).to(torch.bfloat16))                 # 2 rows, few outputs, bf16: the GEMV
        layer(rnd(lin.MAX_ROWS + 1, 64).to(torch.bfloat16))  # too many rows
        wide(rnd(1, 64).to(torch.bfloat16))                  # one row, many outputs: the GEMV
        wide(rnd(2, 64).to(torch.bfloat16))                  # two rows, many outputs: cuBLAS
        layer.float()(rnd(2, 64))                            # fp32
    assert calls == [(2, 64), (1, 64)]
    layer = layer.to(torch.bfloat16)
    layer(rnd(2, 64).to(torch.bfloat16)).sum().backward()    # a gradient wanted: F.linear
    assert calls == [(2, 64), (1, 64)] and layer.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (128, 2048), (6144, 4096)])
def test_gemv_on_gpu_matches_f_linear(N, K):
    dev = torch.device("cuda")
    w = (rnd(N, K, seed=2) / K ** 0.5).to(torch.bfloat16).to(dev)
    for M in range(1, lin.MAX_ROWS + 1):   # (the kernel itself takes any row count)
        x = rnd(M, K, seed=M).to(torch.bfloat16).to(dev)
        want = F.linear(x.float(), w.float()).to(torch.bfloat16)
        got = lin.gemv(x, w)
        # one rounding of an fp32 sum: at most one bf16 ulp from the fp32 reference's rounding
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)
