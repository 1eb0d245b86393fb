"""The MoE layer: routers against an independent per-token reference, and the Triton fused-MoE
kernel (under the Triton interpreter on CPU) against the per-expert PyTorch loop."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from adaspec.layers import moe as moe_layer
from adaspec.layers.moe import RouterConfig, fused_experts_ref, route

# The kernel cases here run on CPU tensors under Triton's interpreter; on a GPU machine the
# compiled kernels take device tensors: tests/gpu/test_moe_gpu.py checks them there.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                                  reason="triton not installed, or a GPU (tests/gpu covers the device)")


# ---- routing ----------------------------------------------------------------------------------

def route_by_hand(logits, cfg: RouterConfig, bias=None):
    """One token at a time, in plain Python: {expert id: weight} per token."""
    out = []
    for row in logits.double().tolist():
        E = len(row)
        if cfg.kind == "softmax":
            m = max(row)
            ex = [pow(2.718281828459045, v - m) for v in row]
            p = [v / sum(ex) for v in ex]
            chosen = sorted(range(E), key=lambda e: -p[e])[:cfg.top_k]
            w = {e: p[e] for e in chosen}
            if cfg.renormalize:
                s = sum(w.values())
                w = {e: v / s for e, v in w.items()}
        else:
            s = [1 / (1 + pow(2.718281828459045, -v)) for v in row]
            c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
            size = E // cfg.n_group
            gscore = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(cfg.n_group)]
            groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[:cfg.topk_group]
            cand = [e for g in groups for e in range(g * size, (g + 1) * size)]
            chosen = sorted(cand, key=lambda e: -c[e])[:cfg.top_k]
            w = {e: s[e] for e in chosen}
            if cfg.renormalize:
                tot = sum(w.values()) + 1e-20
                w = {e: v / tot for e, v in w.items()}
            w = {e: v * cfg.scaling for e, v in w.items()}
        out.append(w)
    return out


ROUTER_CASES = {
    "softmax-top2-renorm": (RouterConfig("softmax", 8, 2, renormalize=True), False),
    "softmax-top4-raw": (RouterConfig("softmax", 6, 4), False),
    "softmax-top1": (RouterConfig("softmax", 4, 1), False),
    "sigmoid-bias-groups": (RouterConfig("sigmoid_group", 16, 4, renormalize=True, n_group=4, topk_group=2,
                                         scaling=2.5), True),
    "sigmoid-one-group-raw": (RouterConfig("sigmoid_group", 8, 3), True),
}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_router_matches_a_per_token_reference(case):
    cfg, with_bias = ROUTER_CASES[case]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, cfg.num_experts, generator=g) * 2
    # A large bias changes the selection (and, with groups, which groups survive) but not the weights.
    bias = torch.randn(cfg.num_experts, generator=g) * 0.5 if with_bias else None
    weights, ids = route(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.shape == (12, cfg.top_k)
    for t, want in enumerate(route_by_hand(logits, cfg, bias)):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), f"token {t}: experts {sorted(got)} != {sorted(want)}"
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5)


def test_group_limited_selection_excludes_dropped_groups():
    """Expert 0 has the best score of all but sits in a group whose second-best is poor: with
    topk_group=1 it is not chosen; with all groups kept it is."""
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0            # group 0 = experts 0..3: one strong expert
    logits[0, 4:6] = 2.0          # group 1 = experts 4..7: two good ones
    one = RouterConfig("sigmoid_group", 8, 2, n_group=2, topk_group=1)
    assert sorted(route(logits, one)[1][0].tolist()) == [4, 5]
    both = RouterConfig("sigmoid_group", 8, 2, n_group=2, topk_group=2)
    assert 0 in route(logits, both)[1][0].tolist()


@pytest.mark.parametrize("kw,match", [
    (dict(kind="nope", num_experts=4, top_k=1), "router kind"),
    (dict(kind="softmax", num_experts=4, top_k=5), "top_k"),
    (dict(kind="sigmoid_group", num_experts=8, top_k=2, n_group=3), "n_group"),
    (dict(kind="sigmoid_group", num_experts=8, top_k=2, n_group=2, topk_group=3), "topk_group"),
    (dict(kind="sigmoid_group", num_experts=8, top_k=5, n_group=2, topk_group=1), "exceeds"),
])
def test_bad_router_config(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)


# ---- fused-MoE kernel vs the reference ------------------------------------------------------------

def _experts(E, H, I, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype),
            (torch.randn(E, H, I, generator=g) * 0.2).to(dtype))


def _uneven_ids(T, k, E):
    """Most pairs on experts 0 and 1, a few on 2, none on E-3..E-1 (empty experts)."""
    ids = torch.empty(T, k, dtype=torch.long)
    for t in range(T):
        pool = [0, 1, 2] if t % 5 == 4 else [0, 1] + list(range(3, E - 3))
        ids[t] = torch.tensor([pool[(t + j) % len(pool)] for j in range(k)])
    return ids


KERNEL_CASES = {  # name: (T, E, H, I, router config or "uneven")
    "top1": (5, 4, 32, 48, RouterConfig("softmax", 4, 1)),
    "top2-renorm": (9, 8, 32, 48, RouterConfig("softmax", 8, 2, renormalize=True)),
    "top2-uneven-empty": (23, 10, 32, 32, "uneven"),
    "top8-raw": (3, 16, 32, 32, RouterConfig("softmax", 16, 8)),
    "sigmoid-bias-groups": (6, 16, 32, 32, RouterConfig("sigmoid_group", 16, 4, renormalize=True, n_group=4,
                                                         topk_group=2, scaling=2.5)),
    "decode-b1-top8": (1, 16, 48, 40, RouterConfig("softmax", 16, 8, renormalize=True)),
    "bucket-80-pairs": (40, 8, 32, 32, RouterConfig("softmax", 8, 2)),
}


def _case_inputs(case: str, seed: int):
    """(x, w13, w2, weights, ids) of KERNEL_CASES[case]: routed by its router config (with a
    random correction bias where the router takes one), or the uneven top-2 ids."""
    T, E, H, I, cfg = KERNEL_CASES[case]
    w13, w2 = _experts(E, H, I)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if cfg == "uneven":
        return x, w13, w2, torch.rand(T, 2, generator=g), _uneven_ids(T, 2, E)
    weights, ids = route(torch.randn(T, E, generator=g), cfg, torch.randn(E, generator=g) * 0.3)
    return x, w13, w2, weights, ids


@needs_triton
@pytest.mark.parametrize("path", ["small", "aligned"])
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_fused_moe_kernel_matches_reference(case, path):
    from adaspec.layers.moe.triton_kernels import fused_experts_triton

    x, w13, w2, weights, ids = _case_inputs(case, seed=1)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    got = fused_experts_triton(x, w13, w2, weights, ids, path=path)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", ["top2-uneven-empty", "top8-raw", "decode-b1-top8"])
def test_expert_parallel_parts_sum_to_the_whole(case, ranks, monkeypatch):
    """Expert parallelism: each rank holds a contiguous run of experts and passes the router's
    global ids with `first_expert`; slots of other ranks' experts add nothing, so the ranks'
    parts sum to the whole layer. The reference on CPU; under the interpreter (where it is
    installed) both kernel paths too, whose aligned path must zero the rows of skipped slots."""
    from adaspec.layers.moe import fused_experts, local_ids
    from adaspec.parallel import Shard

    x, w13, w2, weights, ids = _case_inputs(case, seed=4)
    E = w13.shape[0]   # 10 or 16: over 3 ranks, runs of unequal length
    whole = fused_experts_ref(x, w13, w2, weights, ids)
    runs = [Shard(r, ranks, expert_parallel=True).experts(E) for r in range(ranks)]
    assert local_ids(torch.tensor([[0, 3, 4, E - 1]]), 4, 3).tolist() == [[-1, -1, 0, -1]]
    paths = [None]
    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        paths += ["small", "aligned"]
        from adaspec.layers.moe import triton_kernels as tk
        real = tk.fused_experts_triton
    for path in paths:
        if path is not None:   # through the dispatch, the kernel path forced
            monkeypatch.setattr(moe_layer, "use_triton", lambda t: True)
            monkeypatch.setattr(tk, "fused_experts_triton", functools.partial(real, path=path))
        parts = [fused_experts(x, w13[run.start:run.stop], w2[run.start:run.stop], weights, ids,
                               first_expert=run.start, routed_experts=E) for run in runs]
        assert all(not torch.equal(p, whole) for p in parts), path   # each rank holds only a share
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5, msg=lambda m: f"{path}: {m}")


@needs_triton
def test_expert_parallel_plans_for_the_whole_layer(monkeypatch):
    """A rank's share of the experts has the whole layer's rows per expert, so the dispatch
    plans path and launch (the measured table) for the router's expert count, not the share's."""
    from adaspec.layers.moe import fused_experts, triton_kernels as tk

    seen, real = [], tk.plan
    monkeypatch.setattr(tk, "plan", lambda T, k, E, *a, **kw: seen.append(E) or real(T, k, E, *a, **kw))
    monkeypatch.setattr(moe_layer, "use_triton", lambda t: True)
    w13, w2 = _experts(16, 32, 24)
    weights, ids = route(torch.randn(3, 16), RouterConfig("softmax", 16, 2))
    fused_experts(torch.randn(3, 32), w13[8:], w2[8:], weights, ids, first_expert=8, routed_experts=16)
    assert seen == [16]
    with pytest.raises(ValueError, match="go together"):
        fused_experts(torch.randn(3, 32), w13[8:], w2[8:], weights, ids, first_expert=8)


# T, k, E, H, I, ids ("route": softmax top-k; "uneven": _uneven_ids, repeats and empty experts),
# small-path launch (None: the default, whose tiles exceed these H and I: one masked step;
# "tiny": 16-wide K steps, so the loops run several masked steps)
SMALL_CASES = [(1, 1, 8, 32, 24, "route", None), (1, 2, 8, 48, 40, "route", "tiny"),
               (1, 8, 16, 48, 40, "route", "tiny"), (2, 8, 16, 32, 24, "uneven", None),
               (3, 2, 10, 40, 24, "uneven", "tiny"), (7, 1, 10, 32, 24, "uneven", None),
               (7, 2, 16, 32, 40, "route", "tiny"), (3, 3, 8, 32, 24, "uneven", None)]   # k = 3: padded slots
TINY_SMALL = {"BLOCK_N": 16, "BLOCK_K": 16, "DOWN_BLOCK_N": 8, "DOWN_BLOCK_K": 16}


def _small_inputs(T, k, E, H, I, kind, dtype=torch.float32, seed=2):
    w13, w2 = _experts(E, H, I, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(dtype)
    if kind == "uneven":
        return x, w13, w2, torch.rand(T, k, generator=g), _uneven_ids(T, k, E)
    return (x, w13, w2) + route(torch.randn(T, E, generator=g), RouterConfig("softmax", E, k, renormalize=True))


@needs_triton
@pytest.mark.parametrize("case", range(len(SMALL_CASES)))
def test_small_path_matches_reference(case):
    """fp32: the small path (one row block per pair, the top-k sum inside the down kernel)
    equals the per-expert loop for top-1/2/3/8, T = 1..7, repeated and empty experts."""
    from adaspec.layers.moe.triton_kernels import fused_experts_triton

    T, k, E, H, I, kind, launch = SMALL_CASES[case]
    x, w13, w2, weights, ids = _small_inputs(T, k, E, H, I, kind)
    got = fused_experts_triton(x, w13, w2, weights, ids, TINY_SMALL if launch else None, path="small")
    torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [1, 2, 4, 7])
def test_small_path_keeps_the_rounding_contract(case, dtype):
    """Reduced precision: the small path equals the rounding contract written out in torch
    (moe_oracle.contract_ref) bit for bit, and so does the aligned path, so the two paths are
    equal, not merely close. fp16 and bf16 with the rounding Triton applies here (the
    interpreter rounds bf16 toward zero; its tl.dot in bf16 is broken, so the aligned path only
    runs in fp16 here); a tolerance of one ulp on a few elements covers fp32 sum orders."""
    from moe_oracle import contract_ref, round_nearest, triton_bf16_rounding

    from adaspec.layers.moe.triton_kernels import fused_experts_triton

    T, k, E, H, I, kind, launch = SMALL_CASES[case]
    x, w13, w2, weights, ids = _small_inputs(T, k, E, H, I, kind, dtype)
    round_to = triton_bf16_rounding() if dtype == torch.bfloat16 else round_nearest(dtype)
    ref = contract_ref(x, w13, w2, weights, ids, round_to, round_weights=True)
    paths = ["small", "aligned"] if dtype == torch.float16 else ["small"]
    for path in paths:
        cfg = (TINY_SMALL if path == "small" else {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}) if launch else None
        got = fused_experts_triton(x, w13, w2, weights, ids, cfg, round_weights=True, path=path).float()
        assert float((got == ref).float().mean()) >= 0.95, path
        ulp = 2.0 ** -(10 if dtype == torch.float16 else 7)
        torch.testing.assert_close(got, ref, rtol=ulp, atol=ulp * float(ref.abs().max()))


@needs_triton
def test_dispatch_takes_the_small_path_for_few_pairs(monkeypatch):
    """No alignment kernel (and no reduce) where use_small_path says so; the aligned path beyond."""
    from adaspec.layers.moe import triton_kernels as tk

    assert tk.use_small_path(1, 8, 128) and tk.use_small_path(8, 8, 128) and not tk.use_small_path(9, 8, 128)
    assert tk.use_small_path(1, 8, 8) and not tk.use_small_path(2, 8, 16)   # N > E/2: repeats expected
    calls = []
    real_align = tk.align
    monkeypatch.setattr(tk, "align", lambda *a: calls.append(1) or real_align(*a))
    w13, w2 = _experts(16, 32, 24)
    for T, want in ((1, 0), (2, 1)):
        weights, ids = route(torch.randn(T, 16), RouterConfig("softmax", 16, 8, renormalize=True))
        x = torch.randn(T, 32)
        got = tk.fused_experts_triton(x, w13, w2, weights, ids)
        torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
        assert len(calls) == want, T


@needs_triton
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("block_m,T", [(16, 23), (32, 23), (16, 300)])
def test_alignment_places_every_pair_once(block_m, T, chunked):
    """Both alignments (one program; chunked, here over 1 and 5 chunks of 128 pairs)."""
    from adaspec.layers.moe.triton_kernels import align

    k, E = 2, 10
    ids = _uneven_ids(T, k, E)
    sorted_pairs, block_expert, block_rows = align(ids, E, block_m, chunked=chunked)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    used = int((block_expert >= 0).sum())
    assert used == int(((counts + block_m - 1) // block_m).sum())
    assert (block_expert[used:] == -1).all() and (block_rows[used:] == 0).all()
    assert block_expert[:used].tolist() == sorted(block_expert[:used].tolist())   # experts ascending
    seen = []
    for b in range(used):
        rows = sorted_pairs[b * block_m: b * block_m + int(block_rows[b])].tolist()
        assert all(int(flat[p]) == int(block_expert[b]) for p in rows)
        seen += rows
    assert sorted(seen) == list(range(T * k))
    assert seen == sorted(seen, key=lambda p: (int(flat[p]), p))   # pair order kept within an expert
    # Ids of -1 (experts on another rank) place no pair; the others' layout is unchanged.
    gone = ids.clone()
    gone[::3, 0] = -1
    sp, be, br = align(gone, E, block_m, chunked=chunked)
    kept = [p for p in range(T * k) if int(gone.reshape(-1)[p]) >= 0]
    rows = [r for b in range(int((be >= 0).sum())) for r in sp[b * block_m: b * block_m + int(br[b])].tolist()]
    assert sorted(rows) == kept and len(kept) < T * k
    if chunked:   # the same layout as the one-program alignment, row for row
        one = align(ids, E, block_m, chunked=False)
        assert torch.equal(one[1], block_expert) and torch.equal(one[2], block_rows)
        for b in range(used):
            rows = slice(b * block_m, b * block_m + int(block_rows[b]))
            assert torch.equal(one[0][rows], sorted_pairs[rows])


@needs_triton
def test_kernel_launch_parameters_do_not_change_the_result():
    from adaspec.layers.moe.triton_kernels import fused_experts_triton

    T, E, H, I = 13, 8, 48, 40
    w13, w2 = _experts(E, H, I, seed=3)
    x = torch.randn(T, H)
    weights, ids = route(torch.randn(T, E), RouterConfig("softmax", 8, 2, renormalize=True))
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    for cfg in ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32},
                {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 32,
                 "down_num_warps": 2, "down_num_stages": 2},   # the down GEMM's own launch
                {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "N_FIRST": 1},   # N tiles first, both GEMMs
                {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "DOWN_N_FIRST": 1}):   # down's alone
        got = fused_experts_triton(x, w13, w2, weights, ids, cfg, path="aligned")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for cfg in (TINY_SMALL, {"BLOCK_N": 32, "BLOCK_K": 32, "DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 64, "num_stages": 2}):
        got = fused_experts_triton(x, w13, w2, weights, ids, cfg, path="small")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_aligned_grid_order():
    """Blocks first unless the launch asks for N tiles first; that order falls back to blocks
    first where the blocks outnumber a grid's second dimension."""
    from adaspec.layers.moe import triton_kernels as tk

    assert tk._grid(100, 12, 0) == ((100, 12), False)
    assert tk._grid(100, 12, 1) == ((12, 100), True)
    assert tk._grid(tk.MAX_GRID_YZ + 1, 12, 1) == ((tk.MAX_GRID_YZ + 1, 12), False)
    assert tk.down_launch({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "N_FIRST": 1})["N_FIRST"] == 1
    assert tk.down_launch({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "N_FIRST": 1, "DOWN_N_FIRST": 0})["N_FIRST"] == 0
    assert tk.down_launch({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})["N_FIRST"] == 0


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4_moe", "qwen2_moe"])
def test_sparse_block_with_shared_experts_on_the_kernel(arch, tmp_path, monkeypatch):
    """A whole sparse block (router, experts, shared expert(s), Qwen2's sigmoid gate) through the
    kernel's dispatch equals the block on the reference path."""
    from moe_models import make_moe_model

    from adaspec.models.loader import load_model
    from adaspec.models.moe import SparseMoeBlock

    model, _, _ = load_model(make_moe_model(tmp_path / arch, arch), torch.device("cpu"), "float32")
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert block.shared is not None
    x = torch.randn(11, model.spec.hidden_size)
    with torch.no_grad():
        ref = block(x)
        monkeypatch.setattr(moe_layer, "use_triton", lambda t: True)
        got = block(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dispatch_uses_the_reference_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(moe_layer, "fused_experts_ref", lambda *a: called.append(1) or a[0])
    x = torch.randn(2, 8)
    w13, w2 = _experts(2, 8, 4)
    moe_layer.fused_experts(x, w13, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    assert called == [1]


@needs_triton
@pytest.mark.parametrize("E,k,renorm", [(8, 2, True), (6, 4, False), (128, 8, True), (4, 1, False)])
def test_fused_softmax_router_matches_torch(E, k, renorm):
    from adaspec.layers.moe.routing import softmax_topk
    from adaspec.layers.moe.triton_kernels import softmax_topk_triton

    logits = torch.randn(7, E, generator=torch.Generator().manual_seed(E))
    cfg = RouterConfig("softmax", E, k, renormalize=renorm)
    w_ref, ids_ref = softmax_topk(logits, cfg)
    w, ids = softmax_topk_triton(logits, k, renorm)
    assert ids.dtype == torch.int64 and torch.equal(ids, ids_ref)   # both in descending weight order
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


@needs_triton
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("routed", [None, 32])
def test_warm_up_runs_every_launch_once(monkeypatch, top_k, routed):
    """warm_up makes one call per distinct (path, alignment, launch config) that the dispatch
    picks for 1..WARM_UP_MAX_PAIRS pairs, both paths and both alignments included (each its own
    kernels to compile), with the model's round_weights; under expert parallelism (16 of 32
    routed experts here) the plans of the whole layer, which the forward uses too."""
    from adaspec.layers.moe import triton_kernels as tk

    seen = []

    def key(T, experts=routed or 16):
        p, c = tk.plan(T, top_k, experts, 16, 8, 4)
        return p, T * top_k > tk.ONE_PROGRAM_MAX_PAIRS, tuple(sorted(c.items()))

    def record(x, w13, w2, weights, ids, config=None, round_weights=False, path=None, routed_experts=None):
        seen.append((key(x.shape[0], routed_experts or w13.shape[0]), round_weights))

    monkeypatch.setattr(tk, "fused_experts_triton", record)
    w13, w2 = _experts(16, 16, 8)
    assert tk.warm_up(w13, w2, top_k, torch.float32, round_weights=True, routed_experts=routed) == len(seen)
    assert all(rw for _, rw in seen)
    keys = [k for k, _ in seen]
    assert len(set(keys)) == len(keys)
    served = {key(T) for T in range(1, tk.WARM_UP_MAX_PAIRS // top_k + 1)}
    assert {(p, big) for p, big, _ in keys if p == "aligned"} == {("aligned", False), ("aligned", True)}
    assert served == set(keys) and {p for p, _, _ in keys} == {"small", "aligned"}


@needs_triton
@pytest.mark.parametrize("path", ["small", "aligned"])
def test_kernel_rounds_weights_to_the_model_dtype_like_the_reference(path):
    """Qwen's routing weights are rounded to the model dtype before the product (fp16 here,
    which the interpreter computes): the kernel's in-load rounding equals the reference's cast."""
    from adaspec.layers.moe.triton_kernels import fused_experts_triton

    T, E, H, I = 6, 8, 32, 32
    w13, w2 = _experts(E, H, I, seed=5, dtype=torch.float16)
    x = torch.randn(T, H).half()
    weights, ids = route(torch.randn(T, E), RouterConfig("softmax", E, 2, renormalize=True))
    weights = weights + 1e-3   # not representable in fp16: rounding matters
    ref = moe_layer.fused_experts(x, w13, w2, weights, ids, round_weights=True)       # reference path (CPU)
    assert not torch.equal(ref, moe_layer.fused_experts(x, w13, w2, weights, ids))
    got = fused_experts_triton(x, w13, w2, weights, ids, round_weights=True, path=path)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)


@needs_triton
def test_launch_tiles_fit_shared_memory_for_the_dtype():
    """The measured table is bf16's; fp32 takes twice the shared memory per tile, so the same
    launch is shrunk to fit (on the H200 the table's 512-pair launch failed in fp32), while
    bf16 launches of the committed table stay exactly as measured."""
    from adaspec.layers.moe import triton_kernels as tk

    big = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    need = lambda c, b: c["num_stages"] * (c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"]) * b  # noqa: E731
    assert need(big, 4) > tk.SMEM_BUDGET
    fp32 = tk.fit_shared_memory(big, 4)
    assert need(fp32, 4) <= tk.SMEM_BUDGET and fp32["BLOCK_M"] == 16 and fp32["num_stages"] == 2
    assert tk.fit_shared_memory(big, 2) == big
    for pairs in (8, 512, 4096, 10 ** 6):
        cfg = tk._table("E128_H2048_I768")
        raw = next((cfg[b] for b in sorted(cfg) if pairs <= b), cfg[max(cfg)])
        assert tk.launch_config(pairs, 128, 2048, 768, 2) == {**raw, "num_stages": raw.get("num_stages", 3)}
        assert need(tk.launch_config(pairs, 128, 2048, 768, 4), 4) <= tk.SMEM_BUDGET


def test_warm_up_covers_the_engines_largest_step(monkeypatch):
    """With the engine's max_num_batched_tokens, warm_up reaches the launch buckets of a whole
    prefill chunk (at the Qwen3-30B-A3B shape's measured table, buckets past 8,192 pairs), not
    only those of WARM_UP_MAX_PAIRS: a bucket left cold compiled in the middle of serving."""
    from adaspec.layers.moe import triton_kernels as tk

    E, H, I, k, max_tokens = 128, 2048, 768, 8, 8192
    warmed = []
    monkeypatch.setattr(tk, "fused_experts_triton", lambda x, *a, **kw: warmed.append(x.shape[0]))
    w13, w2 = torch.empty(E, 2 * I, H, device="meta"), torch.empty(E, H, I, device="meta")

    def key(T):
        path, cfg = tk.plan(T, k, E, H, I, 2)
        return path, T * k > tk.ONE_PROGRAM_MAX_PAIRS, tuple(sorted(cfg.items()))

    tk.warm_up(w13, w2, k, torch.bfloat16, max_tokens=max_tokens)
    every = {key(T) for T in range(1, max_tokens + 1)}
    assert {key(T) for T in warmed} == every
    assert every - {key(T) for T in range(1, tk.WARM_UP_MAX_PAIRS // k + 1)}   # buckets only a big step reaches
