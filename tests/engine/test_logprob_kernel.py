"""device.logprobs: the Triton logsumexp path (the Triton interpreter on CPU; compiled on a
GPU) gives the PyTorch path's logprob rows: the same log-probabilities up to the order of the
float32 sums of logsumexp, the same top-k values, and ids that name those values (equal logits
may list in either order)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from adaspec.device import logprobs as lpk

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _check(x: torch.Tensor, rows: torch.Tensor, tg: torch.Tensor, k: int, got: torch.Tensor) -> None:
    ref = lpk.logprob_rows_torch(x, rows, tg, k)
    assert got.shape == ref.shape == (rows.numel(), 1 + 2 * k) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, :1 + k], ref[:, :1 + k], rtol=0, atol=2e-5)
    if k:
        ids = got[:, 1 + k:].long()
        assert ((ids >= 0) & (ids < x.shape[1])).all()
        sel = x.index_select(0, rows).float()
        lse = torch.logsumexp(sel, dim=-1, keepdim=True)
        torch.testing.assert_close(sel.gather(1, ids) - lse, got[:, 1:1 + k], rtol=0, atol=2e-5)
        assert all(len(set(r)) == k for r in ids.tolist())   # k distinct tokens
        # ties aside, the same ids as torch.topk
        assert (got[:, 1 + k:] == ref[:, 1 + k:]).float().mean() > 0.6


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="interpreter path: triton, no CUDA")
@pytest.mark.parametrize("V,dtype,k", [(700, torch.float32, 20), (1100, torch.bfloat16, 5), (300, torch.float32, 0)])
def test_logprob_kernel_equals_torch(monkeypatch, V, dtype, k):
    """Chunks of uneven fill (V not a multiple of the block), repeated and out-of-order rows,
    a row of a strided view, one dominant logit."""
    monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")
    monkeypatch.setattr(lpk, "BLOCK_V", 256)   # several chunks per row at test sizes
    g = torch.Generator().manual_seed(V + k)
    x = (torch.randn(10, V + 8, generator=g) * 4).to(dtype)[:, 3:3 + V]   # row stride != V
    x[2, 17] = 50.0    # one dominant logit: its chunk's maximum, logprob ~ 0
    rows = torch.tensor([2, 0, 9, 9, 4], dtype=torch.int64)
    tg = torch.tensor([17, 0, V - 1, 5, 123], dtype=torch.int64)
    def boom(*a, **kw):
        raise AssertionError("the Triton path fell back to PyTorch")
    monkeypatch.setattr(lpk, "logprob_rows_torch", boom)
    got = lpk.logprob_rows(x, rows, tg, k)
    monkeypatch.undo()
    _check(x, rows, tg, k, got)
    assert abs(got[0, 0].item()) < 1e-4   # the dominant token


def test_logprob_rows_torch_path_is_the_reference():
    """Without Triton on the tensor's device the PyTorch path runs: log-softmax at the target,
    then the top k in order."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 10], dtype=torch.float32)
    out = lpk.logprob_rows(x, torch.tensor([0]), torch.tensor([3]), 2)
    ls = torch.log_softmax(x, -1)[0]
    assert out.shape == (1, 5)
    assert out[0, 0].item() == pytest.approx(ls[3].item(), abs=1e-6)
    assert out[0, 1:3].tolist() == pytest.approx([ls[3].item()] * 2, abs=1e-6)
    assert all(x[0, int(i)].item() == 3.0 for i in out[0, 3:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("V", [128256, 151936, 32000])
def test_cuda_logprob_kernel_equals_torch(V):
    """The compiled kernel at real vocabulary sizes, bf16 logits of a verify batch, in a CUDA
    graph as the post graphs replay it."""
    g = torch.Generator(device="cuda").manual_seed(V)
    x = torch.randn(256, V, device="cuda", generator=g).mul(3).bfloat16()
    rows = torch.randperm(256, device="cuda", generator=g)[:96]
    tg = torch.randint(0, V, (96,), device="cuda", generator=g)
    _check(x, rows, tg, 20, lpk.logprob_rows(x, rows, tg, 20))
    _check(x, rows, tg, 0, lpk.logprob_rows(x, rows, tg, 0))
    lpk.logprob_rows(x, rows, tg, 20)   # warm (compile) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lpk.logprob_rows(x, rows, tg, 20)
    x.copy_(torch.randn(256, V, device="cuda", generator=g).mul(3).bfloat16())
    graph.replay()
    _check(x, rows, tg, 20, out)
