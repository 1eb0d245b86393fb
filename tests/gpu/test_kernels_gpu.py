"""Fast-path kernels on the GPU (skipped without one): the attention launches of the measured
table (layers/attention/launch_table.py) against the torch reference, and a chain of
PDL-launched kernels (layers/pdl.py) replayed from a CUDA graph bit for bit equal to the same
kernels launched without PDL."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspec.layers.attention import launch_table
from adaspec.layers.attention.meta import AttnMeta, launch_plan
from adaspec.layers.attention.torch_ref import torch_paged_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK = 16


def _batch(b: int, q: int, hq: int, hkv: int, d: int, ctx: int, dev, seed: int = 0):
    """b requests of `ctx` keys, the last q of them this forward's rows (a chain: causal), on
    shuffled pages; (q [T, hq, d], k_cache, v_cache, AttnMeta) in bf16."""
    from adaspec.layers.attention.triton_kernels import choose_block_q

    g = torch.Generator().manual_seed(seed)
    pages = -(-ctx // BLOCK)
    k = torch.randn(b * pages * BLOCK, hkv, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(b * pages * BLOCK, hkv, d, generator=g).to(dev, torch.bfloat16)
    table = torch.randperm(b * pages, generator=g).view(b, pages).to(dev, torch.int32)
    bq = choose_block_q(q, hq // hkv, b)
    pr, p0 = launch_plan([q] * b, bq)
    i32 = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.int32, device=dev)  # noqa: E731
    ci = np.tile(ctx - q + np.arange(q), b)
    meta = AttnMeta(positions=torch.as_tensor(ci, dtype=torch.int64, device=dev), cache_index=i32(ci),
                    slot_mapping=torch.full((b * q,), -1, dtype=torch.int64, device=dev),
                    query_start=i32(np.arange(b + 1) * q), ctx_len=i32([ctx] * b), kv_start=i32([0] * b),
                    req_row=i32(np.arange(b)), mask_start=i32([ctx] * b), mask_offset=i32([0] * b),
                    block_table=table, mask=torch.zeros(1, dtype=torch.uint8, device=dev),
                    prog_req=torch.as_tensor(pr, device=dev), prog_q0=torch.as_tensor(p0, device=dev),
                    block_q=bq, block_size=BLOCK, max_ctx_len=ctx, max_q_len=q)
    qt = torch.randn(b * q, hq, d, generator=g).to(dev, torch.bfloat16)
    return qt, k, v, meta


ENTRIES = [(int(qk[1:]), int(b)) for layout, by_q in launch_table._table(str(launch_table.TABLE_FILE)).items()
           if layout == "G8_D128" for qk, by_b in by_q.items() for b in by_b]


@pytest.mark.parametrize("q,b", ENTRIES or [pytest.param(1, 1, marks=pytest.mark.skip("no G8 table"))])
def test_table_launches_match_reference(q, b):
    """Every launch the shipped table holds for the Qwen3-30B-A3B heads (32 q / 4 kv) gives
    the reference's attention within bf16 rounding; the launch plan takes its block_q."""
    from adaspec.layers.attention.triton_kernels import triton_paged_attention

    dev = torch.device("cuda")
    qt, k, v, meta = _batch(b, q, 32, 4, 128, 512 + q, dev)
    want = launch_table.lookup(8, 128, q, b)
    assert meta.block_q == min(want["block_q"], 1 << (q - 1).bit_length())
    got = triton_paged_attention(qt, k, v, meta, 128 ** -0.5)
    ref = torch_paged_attention(qt.float(), k.float(), v.float(), meta, 128 ** -0.5)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch):
    """RMSNorm -> GEMV -> rotary + KV store -> attention (split) -> GEMV, each launched with
    programmatic dependent launch and captured in a CUDA graph, replayed on new inputs: the
    same bits as the chain launched without PDL (eager)."""
    from adaspec.engine.cuda_graph import record
    from adaspec.layers import fused_ops, pdl
    from adaspec.layers.linear import gemv
    from adaspec.layers.rotary import RotaryEmbedding
    from adaspec.layers.attention.triton_kernels import triton_paged_attention

    monkeypatch.setenv("ADASPEC_PDL", "1")   # on, whatever an engine built earlier chose (layers/pdl.py)
    dev = torch.device("cuda")
    if not pdl.enabled(torch.zeros(1, device=dev)):
        pytest.skip("PDL needs compute capability 9+ and a Triton with launch_pdl")
    H, hq, hkv, d, ctx = 512, 8, 2, 64, 300
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    norm_w, wqkv, wo = rnd(H), rnd((hq + 2 * hkv) * d, H) * 0.05, rnd(H, hq * d) * 0.05
    qt, k, v, meta = _batch(1, 1, hq, hkv, d, ctx, dev)
    meta.slot_mapping = torch.tensor([int(meta.block_table[0, (ctx - 1) // BLOCK]) * BLOCK + (ctx - 1) % BLOCK],
                                     device=dev)
    cos_sin = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 10000.0}, 1024).cos_sin_cache(1024, dev)
    x = rnd(1, H)

    def chain():
        h, _ = fused_ops.rms_norm(x, norm_w, 1e-6)
        qkv = gemv(h, wqkv)
        q = fused_ops.rotary_qkv_store(qkv, meta.positions, cos_sin, hq, hkv, d, k, v, meta.slot_mapping)
        a = triton_paged_attention(q, k, v, meta, d ** -0.5, num_splits=2)
        return gemv(a.reshape(1, hq * d), wo)

    k0, v0 = k.clone(), v.clone()
    graph, out = record(chain)          # PDL on (the default)
    results = []
    for seed in (5, 6):
        x.copy_(torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16))
        k.copy_(k0), v.copy_(v0)
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), k.clone()))
    monkeypatch.setenv("ADASPEC_PDL", "0")
    assert not pdl.enabled(x)
    for seed, (got, got_k) in zip((5, 6), results):
        x.copy_(torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16))
        k.copy_(k0), v.copy_(v0)
        want = chain()
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(got_k, k)
    assert not torch.equal(results[0][0], results[1][0])   # new inputs, new outputs


def test_chain_steps_kernel_equals_torch_ops():
    """The chain steps' metadata kernel (device/chain_steps.py) writes what its PyTorch ops
    write, on random rows, lengths, depths, shifts and roots, bf16 draft hiddens."""
    from adaspec.device.chain_steps import DEVICE_TOKEN, REAL, SHIFTED, ChainSteps
    from adaspec.device.staging import Staging
    from adaspec.layers.attention import get_backend

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    R, W, B, K = 40, 64, 37, 5
    table = torch.randint(0, 5000, (R, W), generator=g, dtype=torch.int32).to(dev)
    last_count = torch.randint(1, K + 2, (R,), generator=g).to(dev)
    last_token = torch.randint(0, 32000, (R,), generator=g).to(dev)
    hidden = torch.randn(R, 4096, generator=g).to(dev, torch.bfloat16)
    rows = torch.randperm(R - 1, generator=g)[:B].tolist()
    ns = torch.randint(2, 16 * W - 4 * K, (B,), generator=g).tolist()
    depths = torch.randint(0, K + 1, (B,), generator=g).tolist()
    tokens = torch.randint(0, 32000, (B,), generator=g).tolist()
    flags = [REAL * (i % 7 != 0) | SHIFTED * (i % 2) | DEVICE_TOKEN * (i % 3 == 0) for i in range(B)]
    dst = np.zeros((B, K), dtype=np.int64)
    out = []
    for use_kernel in (True, False):
        stg = Staging(1 << 16, dev)
        cs = ChainSteps(48, K, get_backend("triton"), 4, 16, table, last_count, last_token, hidden, stg)
        stg.begin()
        ref, _ = ChainSteps.stage(stg, K, rows, ns, depths, tokens, flags, dst, dst, 3, R - 1)
        stg.commit()
        cs.load(ref)
        if use_kernel:
            cs.derive(K, B + 3)
        else:
            cs._derive_torch(cs.inputs(K, B + 3), K, B + 3)
        torch.cuda.synchronize()
        out.append([t.clone() for t in (cs.pos[:, :B + 3], cs.ci[:, :B + 3], cs.slot[:, :B + 3], cs.ctx[:, :B + 3],
                                        cs.req_row[:B + 3], cs.h0[:B + 3], cs.tok0[:B + 3])])
    for a, b in zip(*out):
        assert torch.equal(a, b)
