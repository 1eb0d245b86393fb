"""Fused ops: the PyTorch references reproduce models/llama.py exactly; the Triton kernels
(run under the Triton interpreter on CPU) match the references (bit-exact where no fp32
reduction order is involved)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from adaspec.layers import fused_ops
from adaspec.layers.rotary import RotaryEmbedding, apply_rotary
from adaspec.models.llama import MLP, RMSNorm

HAS_TRITON = importlib.util.find_spec("triton") is not None
# The interpreter path needs CPU kernels: with CUDA present, Triton compiled them for the GPU (the
# GPU-marked tests below cover that path).
PATHS = ["ref", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                                               reason="interpreter path: triton installed, no CUDA"))]


@pytest.fixture
def path(request, monkeypatch):
    """Select the implementation; on "triton" make the references unreachable, so a test
    cannot pass by falling back to them."""
    if request.param == "triton":
        monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")

        def boom(*a, **k):
            raise AssertionError("the Triton path fell back to the reference")
        for name in ("rms_norm_ref", "silu_and_mul_ref", "rotary_qkv_store_ref"):
            monkeypatch.setattr(fused_ops, name, boom)
    else:
        monkeypatch.delenv("ADASPEC_TRITON_INTERPRET", raising=False)
    return request.param


def rnd(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# The Triton interpreter (3.9 here) truncates fp32 -> bf16 conversions instead of rounding to
# nearest even, so on CPU the Triton bf16 results are only checked within a few bf16 ulps;
# the GPU test below checks the kernels' HF rounding bit for bit.
INTERPRETER_BF16_TOL = dict(atol=3e-2, rtol=3e-2)


def assert_same(got, want, path):
    if path == "ref":
        assert torch.equal(got, want)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, **INTERPRETER_BF16_TOL)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 96])
def test_rms_norm_matches_llama(path, dtype, H):
    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rnd(H, seed=1))
    norm = norm.to(dtype)
    x, res = rnd(5, H, dtype=dtype, seed=2), rnd(5, H, dtype=dtype, seed=3)
    with torch.no_grad():
        out, r = fused_ops.rms_norm(x, norm.weight, 1e-6)
        assert r is x
        assert_same(out, norm(x), path)
        # HF decoder: h = residual + attn_out (rounded to the dtype), then the next norm on h
        out, r = fused_ops.rms_norm(x, norm.weight, 1e-6, residual=res)
        h = res + x
        assert_same(r, h, path)
        assert_same(out, norm(h), path)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_llama_mlp(path, dtype):
    H, inter = 32, 48
    mlp = MLP(H, inter).to(dtype)
    x = rnd(7, H, dtype=dtype, seed=4)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        got = fused_ops.silu_and_mul(gate_up)
        want = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        assert got.shape == (7, inter)
        assert_same(got, want, path)
        assert_same(mlp.down_proj(got), mlp(x), path)


ROPES = [({"rope_type": "default", "rope_theta": 10000.0}, 1.0),
         ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}, 1.0),
         ({"rope_type": "default", "rope_theta": 10000.0}, 0.5)]  # partial rotary


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope,partial", ROPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (14, 2)])   # one program's block of heads; two, the last part-filled
@pytest.mark.parametrize("blocks", [False, True])      # a head per program / blocks of heads (many rows)
def test_rotary_qkv_store_matches_llama(path, dtype, rope, partial, Hq, Hkv, blocks, monkeypatch):
    if blocks:
        monkeypatch.setattr(fused_ops, "ROTARY_ONE_HEAD_MAX_PROGRAMS", 0)
    T, D, max_pos = 6, 16, 64
    rotary = RotaryEmbedding(D, rope, max_pos, partial=partial)
    table = rotary.cos_sin_cache(max_pos, torch.device("cpu"))
    assert table.shape == (max_pos, rotary.rot_dim) and table.dtype == torch.float32
    qkv = rnd(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=5)
    positions = torch.tensor([0, 3, 7, 7, 40, 63])
    slots = torch.tensor([5, -1, 0, 9, 2, 11])
    k_cache = torch.full((12, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((12, Hkv, D), float("nan"), dtype=dtype)
    before = qkv.clone()

    q = fused_ops.rotary_qkv_store(qkv, positions, table, Hq, Hkv, D, k_cache, v_cache, slots)

    # What models/llama.py does: cos/sin for the step in the model dtype, apply_rotary on q and k.
    cos, sin = rotary.cos_sin(positions, dtype)
    q_ref = apply_rotary(before[:, : Hq * D].view(T, Hq, D), cos, sin)
    k_ref = apply_rotary(before[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D), cos, sin)
    v_ref = before[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    assert q.shape == (T, Hq, D) and q.data_ptr() == qkv.data_ptr()  # a view, rotated in place
    if path == "ref":
        check = torch.equal
    else:
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else INTERPRETER_BF16_TOL
        check = lambda a, b: torch.allclose(a, b, **tol)  # noqa: E731
    assert check(q, q_ref)
    assert torch.equal(qkv[:, Hq * D:], before[:, Hq * D:])  # k and v parts untouched
    keep = slots >= 0
    assert check(k_cache[slots[keep]], k_ref[keep])
    assert torch.equal(v_cache[slots[keep]], v_ref[keep])
    unused = torch.ones(12, dtype=torch.bool)
    unused[slots[keep]] = False
    assert k_cache[unused].isnan().all() and v_cache[unused].isnan().all()  # slot -1 wrote nothing


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 3)])
@pytest.mark.parametrize("blocks", [False, True])
def test_rotary_qkv_store_with_head_norms_matches_qwen3(path, dtype, partial, Hq, Hkv, blocks, monkeypatch):
    if blocks:
        monkeypatch.setattr(fused_ops, "ROTARY_ONE_HEAD_MAX_PROGRAMS", 0)
    """q_norm / k_norm in the kernel: what Qwen3 (and GLM's use_qk_norm) does unfused: each q
    and k head RMS-normed (RMSNorm over head_dim), then rotary; v untouched by the norms."""
    T, D, max_pos, eps = 5, 16, 64, 1e-6
    rotary = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 10000.0}, max_pos, partial=partial)
    table = rotary.cos_sin_cache(max_pos, torch.device("cpu"))
    qn, kn = RMSNorm(D, eps), RMSNorm(D, eps)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.2 * rnd(D, seed=8))
        kn.weight.copy_(1 - 0.2 * rnd(D, seed=9))
    qn, kn = qn.to(dtype), kn.to(dtype)
    qkv = 3 * rnd(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=6)
    positions = torch.tensor([0, 5, 9, 30, 63])
    slots = torch.tensor([3, 0, -1, 7, 1])
    k_cache = torch.full((8, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((8, Hkv, D), float("nan"), dtype=dtype)
    before = qkv.clone()
    with torch.no_grad():
        q = fused_ops.rotary_qkv_store(qkv, positions, table, Hq, Hkv, D, k_cache, v_cache, slots,
                                       qn.weight, kn.weight, eps)
        cos, sin = rotary.cos_sin(positions, dtype)
        q_ref = apply_rotary(qn(before[:, : Hq * D].view(T, Hq, D)), cos, sin)
        k_ref = apply_rotary(kn(before[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)), cos, sin)
    v_ref = before[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    keep = slots >= 0
    assert_same(q, q_ref, path)
    assert_same(k_cache[slots[keep]], k_ref[keep], path)
    assert torch.equal(v_cache[slots[keep]], v_ref[keep])
    assert torch.equal(qkv[:, Hq * D:], before[:, Hq * D:])   # the k part of qkv left as it was
    with pytest.raises(ValueError, match="go together"):
        fused_ops.rotary_qkv_store(qkv, positions, table, Hq, Hkv, D, k_cache, v_cache, slots, qn.weight)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="not even"):
        fused_ops.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="weight"):
        fused_ops.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    cache = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="qkv"):
        fused_ops.rotary_qkv_store(torch.zeros(3, 40), torch.zeros(3, dtype=torch.long), torch.zeros(8, 8),
                                   2, 2, 8, cache, cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="rot_dim"):
        fused_ops.rotary_qkv_store(torch.zeros(3, 48), torch.zeros(3, dtype=torch.long), torch.zeros(8, 10),
                                   2, 2, 8, cache, cache, torch.zeros(3, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_ops_on_gpu_match_reference():
    dev, dtype = torch.device("cuda"), torch.bfloat16
    x, res = (rnd(33, 4096, dtype=dtype, seed=s).to(dev) for s in (1, 2))
    w = (1 + 0.1 * rnd(4096, seed=3)).to(dtype).to(dev)
    out, r = fused_ops.rms_norm(x, w, 1e-5, residual=res)
    want, r_want = fused_ops.rms_norm_ref(x, w, 1e-5, residual=res)
    assert torch.equal(r, r_want)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)
    g = rnd(33, 2 * 1024, dtype=dtype, seed=4).to(dev)
    torch.testing.assert_close(fused_ops.silu_and_mul(g), fused_ops.silu_and_mul_ref(g), atol=2e-2, rtol=1e-2)
    rotary = RotaryEmbedding(128, {"rope_type": "default", "rope_theta": 500000.0}, 4096)
    table = rotary.cos_sin_cache(4096, dev)
    qkv = rnd(33, 48 * 128, dtype=dtype, seed=5).to(dev)
    pos = torch.arange(33, device=dev) * 97
    slots = torch.arange(33, device=dev)
    caches = [torch.zeros(64, 8, 128, dtype=dtype, device=dev) for _ in range(4)]
    qkv2 = qkv.clone()
    q = fused_ops.rotary_qkv_store(qkv, pos, table, 32, 8, 128, caches[0], caches[1], slots)
    q2 = fused_ops.rotary_qkv_store_ref(qkv2, pos, table, 32, 8, 128, caches[2], caches[3], slots)
    # V is copied: bit-exact. Rotated q/k: the kernel computes in fp32 and rounds once, the
    # reference rounds after each bf16 op; seen on the H200 to differ by at most bf16 rounding.
    assert torch.equal(caches[1], caches[3])
    torch.testing.assert_close(q, q2, atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-2, rtol=2 ** -7)
    # With Qwen3's head norms fused in: against the reference (norms, then rotary) on the GPU.
    qn, kn = ((1 + 0.2 * rnd(128, seed=s)).to(dtype).to(dev) for s in (6, 7))
    qkv, qkv2 = (3 * rnd(33, 48 * 128, dtype=dtype, seed=8).to(dev) for _ in range(2))
    q = fused_ops.rotary_qkv_store(qkv, pos, table, 32, 8, 128, caches[0], caches[1], slots, qn, kn, 1e-6)
    q2 = fused_ops.rotary_qkv_store_ref(qkv2, pos, table, 32, 8, 128, caches[2], caches[3], slots, qn, kn, 1e-6)
    assert torch.equal(caches[1], caches[3])
    torch.testing.assert_close(q, q2, atol=2e-2, rtol=2 ** -6)
    torch.testing.assert_close(caches[0], caches[2], atol=2e-2, rtol=2 ** -6)
