"""Conformance suite of the paged-attention backends: every backend function against a naive
dense float64 reference written here from the request descriptions (a rows x keys visibility
matrix per request, not AttnMeta's flat arrays, so the metadata encoding is checked too).

The torch reference always runs; the Triton kernels run under the Triton interpreter on CPU
(conftest sets TRITON_INTERPRET=1 when there is no GPU) when `import triton` works. The
interpreter is slow: its cases are few and small.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from adaspec.layers.attention.meta import AttnMeta, launch_plan
from adaspec.layers.attention.torch_ref import torch_paged_attention, torch_store_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None
JUNK_PAGE = 10**6  # block-table padding: a backend that reads it crashes or reads garbage


@dataclass
class Req:
    """One request of a batch: `prefix` cached keys, then `q_len` new rows (keys prefix ..
    prefix + q_len - 1). `parents`: a tree over the new rows (parents[i] < i, -1 = root:
    row i sees the prefix, its ancestors and itself); `tree_as_mask` encodes a chain through
    the flat mask instead of causality. `share` = (request index, pages): the first pages
    are the other request's (a prefix-cache hit); new rows inside them are not stored."""

    prefix: int
    q_len: int
    kv_start: int = 0
    parents: list | None = None
    share: tuple | None = None
    pos_offset: int = 0
    tree: np.ndarray | None = field(default=None, init=False)

    def __post_init__(self):
        if self.parents is not None:
            n = self.q_len
            self.tree = np.zeros((n, n), dtype=bool)
            for i, p in enumerate(self.parents):
                self.tree[i] = self.tree[p] if p >= 0 else False
                self.tree[i, i] = True

    @property
    def ctx(self):
        return self.prefix + self.q_len

    def position(self, r):
        depth = self.tree[r].sum() - 1 if self.tree is not None else r
        return self.prefix + int(depth) + self.pos_offset


def chain(n):
    return list(range(-1, n - 1))


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    meta: AttnMeta
    keys: list          # per request: logical K [ctx, Hkv, D], V (what the cache must hold)
    reqs: list


def make_batch(reqs, Hq, Hkv, D, bs, dtype=torch.float32, block_q=1, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    B = len(reqs)
    npages = [max(1, -(-r.ctx // bs)) for r in reqs]
    total = sum(npages) + 3
    free = torch.randperm(total, generator=g).tolist()
    pages, keys = [], []
    for r, n in zip(reqs, npages):
        own = pages[r.share[0]][: r.share[1]] if r.share else []
        pages.append(own + [free.pop() for _ in range(n - len(own))])
    k_cache = torch.full((total * bs, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slot = lambda b, j: pages[b][j // bs] * bs + j % bs  # noqa: E731
    new_k, new_v, slots = [], [], []
    for b, r in enumerate(reqs):
        K, V = rnd(r.ctx, Hkv, D), rnd(r.ctx, Hkv, D)
        shared = min(r.share[1] * bs, r.ctx) if r.share else 0  # keys living in the donor's pages
        if shared:
            a = r.share[0]
            assert reqs[a].prefix >= shared and a < b
            K[:shared], V[:shared] = keys[a][0][:shared], keys[a][1][:shared]
        keys.append((K, V))
        for j in range(r.prefix):
            k_cache[slot(b, j)], v_cache[slot(b, j)] = K[j], V[j]
        for j in range(r.prefix, r.ctx):
            hit = j < shared  # already in the shared page: pass garbage, expect it unused
            new_k.append(rnd(Hkv, D) if hit else K[j])
            new_v.append(rnd(Hkv, D) if hit else V[j])
            slots.append(-1 if hit else slot(b, j))
    T = sum(r.q_len for r in reqs)
    q = rnd(T, Hq, D)
    new_k = torch.stack(new_k) if new_k else torch.zeros(0, Hkv, D, dtype=dtype)
    new_v = torch.stack(new_v) if new_v else torch.zeros(0, Hkv, D, dtype=dtype)

    positions, cache_index, masks, mask_start, mask_offset = [], [], [], [], []
    off = 0
    for r in reqs:
        for i in range(r.q_len):
            positions.append(r.position(i))
            cache_index.append(r.prefix + i)
        if r.tree is not None:
            masks.append(torch.from_numpy(r.tree.astype(np.uint8)).flatten())
            mask_start.append(r.prefix)
            mask_offset.append(off)
            off += r.tree.size
        else:
            mask_start.append(r.ctx)
            mask_offset.append(0)
    W = max(npages) + 2
    req_row = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)  # live rows, not 0..B-1
    table = torch.full((B + 1, W), JUNK_PAGE, dtype=torch.int32)
    for b in range(B):
        table[req_row[b], : len(pages[b])] = torch.tensor(pages[b], dtype=torch.int32)
    q_lens = [r.q_len for r in reqs]
    prog_req, prog_q0 = launch_plan(q_lens, block_q)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    meta = AttnMeta(
        positions=torch.tensor(positions, dtype=torch.int64),
        cache_index=i32(cache_index),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start=i32([0] + np.cumsum(q_lens).tolist()),
        ctx_len=i32([r.ctx for r in reqs]),
        kv_start=i32([r.kv_start for r in reqs]),
        req_row=req_row,
        mask_start=i32(mask_start),
        mask_offset=i32(mask_offset),
        block_table=table,
        mask=torch.cat(masks) if masks else torch.zeros(1, dtype=torch.uint8),
        prog_req=torch.from_numpy(prog_req),
        prog_q0=torch.from_numpy(prog_q0),
        block_q=block_q,
        block_size=bs,
        max_ctx_len=max(r.ctx for r in reqs),
        max_q_len=max(q_lens),
    )
    return Batch(q, k_cache, v_cache, new_k, new_v, meta, keys, reqs)


def dense_reference(batch: Batch, scale: float, window=None) -> torch.Tensor:
    """Dense float64 attention over each request's logical keys, visibility written out from
    the request description (rows x keys), one request at a time."""
    q = batch.q.double()
    T, Hq, D = q.shape
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    t = 0
    for r, (K, V) in zip(batch.reqs, batch.keys):
        if r.q_len == 0:
            continue
        G = Hq // K.shape[1]
        i = np.arange(r.q_len)[:, None]
        j = np.arange(r.ctx)[None, :]
        if r.tree is None:
            vis = j <= r.prefix + i
        else:
            vis = (j < r.prefix) | np.concatenate([np.zeros((r.q_len, r.prefix), bool), r.tree], axis=1)
        vis = vis & (j >= r.kv_start)
        if window is not None:
            pos = np.array([r.position(x) for x in range(r.q_len)])[:, None]
            vis = vis & (j > pos - window)
        vis = torch.from_numpy(vis)
        k = K.double().repeat_interleave(G, dim=1)  # [ctx, Hq, D]
        v = V.double().repeat_interleave(G, dim=1)
        s = torch.einsum("thd,nhd->htn", q[t: t + r.q_len], k) * scale
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)  # no key: 0
        out[t: t + r.q_len] = torch.einsum("htn,nhd->thd", p, v)
        t += r.q_len
    return out


def _torch_backend():
    return torch_store_kv, torch_paged_attention


def _triton_backend():
    from adaspec.layers.attention.triton_kernels import triton_paged_attention, triton_store_kv
    return triton_store_kv, triton_paged_attention


BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("triton", id="triton",
                         marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed"))]


def _to(batch: Batch, dev: torch.device) -> Batch:
    """The batch's tensors on `dev` (the Triton backend on a GPU machine runs compiled kernels)."""
    import dataclasses
    meta = dataclasses.replace(batch.meta, **{f.name: getattr(batch.meta, f.name).to(dev)
                                              for f in dataclasses.fields(batch.meta)
                                              if isinstance(getattr(batch.meta, f.name), torch.Tensor)})
    return dataclasses.replace(batch, q=batch.q.to(dev), k_cache=batch.k_cache.to(dev), v_cache=batch.v_cache.to(dev),
                               new_k=batch.new_k.to(dev), new_v=batch.new_v.to(dev), meta=meta)


def run(backend, batch: Batch, scale, window=None, **kw):
    store, attn = (_torch_backend if backend == "torch" else _triton_backend)()
    if backend == "triton" and torch.cuda.is_available():
        dev = _to(batch, torch.device("cuda"))
        store(dev.k_cache, dev.v_cache, dev.new_k, dev.new_v, dev.meta.slot_mapping)
        out = attn(dev.q, dev.k_cache, dev.v_cache, dev.meta, scale, window, **kw)
        batch.k_cache.copy_(dev.k_cache.cpu())
        batch.v_cache.copy_(dev.v_cache.cpu())
        return out.cpu()
    store(batch.k_cache, batch.v_cache, batch.new_k, batch.new_v, batch.meta.slot_mapping)
    return attn(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, **kw)


def check(backend, batch, window=None, dtype=torch.float32, **kw):
    scale = batch.q.shape[-1] ** -0.5
    got = run(backend, batch, scale, window, **kw)
    assert got.shape == batch.q.shape and got.dtype == batch.q.dtype
    want = dense_reference(batch, scale, window)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    return got


def mixed(bs):
    """Decode rows, a prefill chunk over a cached prefix, a chain verify, a tree verify, a
    zero-row request, a prefix hit, a padding-like row that sees nothing."""
    return [
        Req(prefix=9, q_len=1),                                 # decode
        Req(prefix=2 * bs + 1, q_len=5),                        # chunked prefill over a prefix
        Req(prefix=7, q_len=0),                                 # scheduled, no rows this step
        Req(prefix=3, q_len=4, parents=chain(4)),               # chain through the flat mask
        Req(prefix=5, q_len=5, parents=[-1, 0, 0, 1, 2]),       # tree
        Req(prefix=max(bs - 2, 0), q_len=3, share=(1, 1)),     # prefix hit: new rows in a shared page
        Req(prefix=0, q_len=1, kv_start=1),                     # sees no key at all
        Req(prefix=4, q_len=2, kv_start=1, pos_offset=-1),      # EAGLE-3 draft: skips key 0
    ]


# ------------------------------------------------------- every backend (the interpreter is fast
# enough on these tiny shapes: ~0.5 s a case)

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs,Hq,Hkv", [(1, 4, 4), (3, 4, 2), (16, 8, 2), (1, 8, 1), (3, 6, 2), (16, 4, 4),
                                       (3, 8, 1)])  # block sizes 1/3/16, GQA groups 1, 2, 4, 8, 3
def test_mixed_batch(backend, bs, Hq, Hkv):
    check(backend, make_batch(mixed(bs), Hq, Hkv, 16, bs, block_q=4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D,block_q", [(8, 1), (64, 2), (80, 8), (128, 2)])
def test_head_dims_and_tiles(backend, D, block_q):
    check(backend, make_batch(mixed(3), 4, 2, D, 3, block_q=block_q))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,bs", [(1, 1), (3, 16), (6, 3)])
def test_sliding_window(backend, window, bs):
    check(backend, make_batch(mixed(bs), 4, 2, 16, bs, block_q=2), window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_long_prefill(backend):
    reqs = [Req(prefix=40, q_len=33), Req(prefix=70, q_len=1), Req(prefix=20, q_len=6, parents=chain(6))]
    check(backend, make_batch(reqs, 8, 2, 64, 16, dtype=torch.bfloat16, block_q=16), dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_seeing_nothing_are_zero_and_garbage_never_read(backend):
    # Exactly zero, although NaNs fill every unwritten slot and JUNK_PAGE pads the table.
    b = make_batch([Req(prefix=0, q_len=2, kv_start=2), Req(prefix=3, q_len=0), Req(prefix=2, q_len=1),
                    Req(prefix=0, q_len=2, parents=[-1, -1])], 4, 4, 8, 3, block_q=1)
    b.meta.mask[:] = 0  # the tree rows see neither a prefix nor a node
    b.reqs[3].tree[:] = False
    out = check(backend, b)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert out[2].abs().sum() > 0


# ---------------------------------------------------------------- every backend (few, small)

@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kv_skips_negative_slots(backend):
    b = make_batch([Req(prefix=4, q_len=2), Req(prefix=1, q_len=3, share=(0, 1))], 2, 2, 8, 3, block_q=1)
    if backend == "triton" and torch.cuda.is_available():  # compiled kernels need device tensors
        b = _to(b, torch.device("cuda"))
    before = b.k_cache.clone()
    store = (_torch_backend if backend == "torch" else _triton_backend)()[0]
    # k as a strided view of a fused buffer, as the fused rotary path produces it
    fused = torch.cat([b.new_k.flatten(1), b.new_v.flatten(1)], dim=1)
    k, v = fused[:, :16].view(-1, 2, 8), fused[:, 16:].view(-1, 2, 8)
    store(b.k_cache, b.v_cache, k, v, b.meta.slot_mapping)
    slots = b.meta.slot_mapping
    assert (slots < 0).sum() == 2  # rows 3, 4 of the second request live in the shared page
    written = slots[slots >= 0]
    torch.testing.assert_close(b.k_cache[written], b.new_k[slots >= 0], atol=0, rtol=0)
    torch.testing.assert_close(b.v_cache[written], b.new_v[slots >= 0], atol=0, rtol=0)
    untouched = torch.ones(len(before), dtype=torch.bool, device=before.device)
    untouched[written] = False
    torch.testing.assert_close(b.k_cache[untouched], before[untouched], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_and_bf16(backend):
    reqs = [Req(prefix=10, q_len=1), Req(prefix=6, q_len=4, parents=[-1, 0, 1, 0]), Req(prefix=5, q_len=5)]
    check(backend, make_batch(reqs, 4, 1, 16, 3, block_q=4), window=4)
    check(backend, make_batch(reqs, 4, 2, 32, 3, dtype=torch.bfloat16, block_q=2), dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa8_head128(backend):
    reqs = [Req(prefix=20, q_len=1), Req(prefix=3, q_len=3, parents=chain(3))]
    check(backend, make_batch(reqs, 8, 1, 128, 16, block_q=2))


def random_reqs(rng: np.random.Generator, bs: int) -> list:
    """A random mix: decode, prefill chunks, chains, trees (random parents), kv_start 0/1,
    a prefix hit on an earlier request, zero-row requests."""
    reqs = []
    for i in range(int(rng.integers(3, 7))):
        kind = rng.choice(["decode", "prefill", "tree", "empty", "hit"])
        prefix = int(rng.integers(0, 3 * bs + 4))
        if kind == "decode":
            reqs.append(Req(prefix=prefix, q_len=1, kv_start=int(rng.integers(0, 2))))
        elif kind == "prefill":
            reqs.append(Req(prefix=prefix, q_len=int(rng.integers(2, 9))))
        elif kind == "tree":
            n = int(rng.integers(2, 7))
            reqs.append(Req(prefix=prefix, q_len=n, parents=[-1] + [int(rng.integers(0, k)) for k in range(1, n)],
                            kv_start=int(rng.integers(0, 2))))
        elif kind == "empty":
            reqs.append(Req(prefix=prefix, q_len=0))
        else:
            donors = [j for j, r in enumerate(reqs) if r.prefix >= bs]
            if donors:
                reqs.append(Req(prefix=int(rng.integers(0, bs)), q_len=int(rng.integers(1, 4)),
                                share=(donors[0], 1)))
    if not any(r.q_len for r in reqs):
        reqs.append(Req(prefix=2, q_len=1))
    return reqs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches(backend, seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 3, 4, 16]))
    Hkv = int(rng.choice([1, 2]))
    G = int(rng.choice([1, 2, 3, 4]))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 12))
    b = make_batch(random_reqs(rng, bs), Hkv * G, Hkv, 16, bs, block_q=int(rng.choice([1, 2, 4, 8])), seed=seed)
    kw = {"num_splits": int(rng.integers(1, 4)), "block_n": 16} if backend == "triton" else {}
    check(backend, b, window=window, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_as_view_of_fused_qkv(backend):
    # rotary_qkv_store returns q as a view of the qkv projection: row stride (Hq + 2 Hkv) * D.
    b = make_batch(mixed(3), 4, 2, 16, 3, block_q=2)
    T = b.q.shape[0]
    qkv = torch.full((T, (4 + 2 * 2) * 16), float("nan"))
    qkv[:, : 4 * 16] = b.q.flatten(1)
    b.q = qkv[:, : 4 * 16].view(T, 4, 16)
    assert not b.q.is_contiguous()
    check(backend, b)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_kv(num_splits):
    # Splits of whole key blocks (BLOCK_N 16): some splits of short requests are empty.
    reqs = [Req(prefix=70, q_len=1), Req(prefix=5, q_len=1), Req(prefix=30, q_len=3, parents=[-1, 0, 0]),
            Req(prefix=0, q_len=1, kv_start=1)]
    b = make_batch(reqs, 4, 2, 16, 16, block_q=1)
    got = check("triton", b, window=50, num_splits=num_splits, block_n=16)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_writes_into_out_and_leaves_other_rows():
    from adaspec.layers.attention.triton_kernels import triton_paged_attention

    b = make_batch([Req(prefix=5, q_len=2), Req(prefix=3, q_len=1)], 2, 1, 16, 3, block_q=1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels: device tensors
    b = _to(b, dev)
    torch_store_kv(b.k_cache, b.v_cache, b.new_k, b.new_v, b.meta.slot_mapping)
    q = torch.cat([b.q, torch.randn(1, 2, 16, device=dev)])  # one padding row beyond the last request
    out = torch.full((4, 2, 16), 7.0, device=dev)
    got = triton_paged_attention(q, b.k_cache, b.v_cache, b.meta, 0.25, out=out)
    assert got is out
    assert torch.equal(out[3], torch.full((2, 16), 7.0, device=dev))
    want = torch_paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.25)
    torch.testing.assert_close(out[:3], want, atol=2e-5, rtol=2e-5)
    # A CUDA graph's fixed grid: the plan padded with programs whose first row lies past their
    # request's end (prog_q0 >= max_q_len) must change nothing and read nothing.
    b.meta.prog_req = torch.cat([b.meta.prog_req, torch.tensor([0, 1], dtype=torch.int32, device=dev)])
    b.meta.prog_q0 = torch.cat([b.meta.prog_q0, torch.tensor([b.meta.max_q_len] * 2, dtype=torch.int32, device=dev)])
    out2 = torch.full((4, 2, 16), 7.0, device=dev)
    triton_paged_attention(q, b.k_cache, b.v_cache, b.meta, 0.25, out=out2, num_splits=2)
    torch.testing.assert_close(out2, out, atol=2e-5, rtol=2e-5)


def test_choose_block_q():
    pytest.importorskip("triton")
    from adaspec.layers.attention.triton_kernels import choose_block_q

    assert choose_block_q(1, 4) == 1
    assert choose_block_q(4, 4) == 4
    assert choose_block_q(5, 4) == 8
    assert choose_block_q(512, 4) == 16
    assert choose_block_q(512, 3) == 16
    assert choose_block_q(512, 1) == 64
    # Few requests: narrower tiles (not below 16 rows) until the grid has enough programs.
    assert choose_block_q(16, 4, num_reqs=16) == 16
    assert choose_block_q(16, 4, num_reqs=8) == 8
    assert choose_block_q(16, 4, num_reqs=1) == 4
    assert choose_block_q(4, 4, num_reqs=1) == 4
    assert choose_block_q(1, 4, num_reqs=1) == 1
    assert choose_block_q(512, 4, num_reqs=1) == 16    # a long prefill has programs enough
    with pytest.raises(ValueError):
        choose_block_q(0, 4)


@pytest.mark.parametrize("n", range(1, 10))
def test_staged_tables_start_16_byte_aligned(n):
    """Every per-request and per-program table a kernel receives starts on a 16-byte boundary
    whatever the batch size: Triton specializes kernels on pointer alignment, and a table at
    4 * n bytes compiled a new variant for each n mod 4 while serving."""
    from adaspec.device.staging import Staging, stage_forward
    from adaspec.layers.attention import get_backend

    stg = Staging(1 << 16, torch.device("cpu"))
    stg.begin()
    stg.add(np.zeros(3, np.uint8), torch.uint8)   # whatever came before
    table = torch.zeros(n + 1, 8, dtype=torch.int32)
    meta, _, _ = stage_forward(stg, get_backend("torch"), table, 4, 1, q_lens=[3] * n, ctx_len=[7] * n,
                               kv_start=[0] * n, req_row=list(range(n)), positions=np.arange(3 * n) % 7,
                               cache_index=np.arange(3 * n) % 7, slots=[-1] * (3 * n))
    base = stg.dev.data_ptr()
    for name in ("positions", "cache_index", "slot_mapping", "query_start", "ctx_len", "kv_start", "req_row",
                 "mask_start", "mask_offset", "mask", "prog_req", "prog_q0"):
        t = getattr(meta, name)
        assert (t.data_ptr() - base) % 16 == 0, (name, n)
    assert meta.ctx_len.tolist() == [7] * n and meta.req_row.tolist() == list(range(n))
    assert len(meta.prog_req) == len(meta.prog_q0) == 3 * n   # block_q 1 (torch backend): a program per row


def test_warm_up_launches_every_variant(monkeypatch):
    """The Triton warm-up launches each block_q up to the cap, with and without split-KV, for
    each window, and touches no cache entry."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter on CPU; the GPU tests cover the device")
    from adaspec.layers.attention import triton_kernels as tk

    seen = []
    real = tk.triton_paged_attention

    def record(q, k, v, meta, scale, window=None, **kw):
        seen.append((meta.block_q, kw["num_splits"], window))
        return real(q, k, v, meta, scale, window, **kw)

    monkeypatch.setattr(tk, "triton_paged_attention", record)
    k = torch.randn(64, 2, 16)
    v = torch.randn(64, 2, 16)
    k0, v0 = k.clone(), v.clone()
    n = tk.warm_up(8, k, v, torch.zeros(3, 4, dtype=torch.int32), 16, torch.float32, {None, 32})
    cap = tk.choose_block_q(1 << 20, 4)
    want = {(bq, s, w) for bq in (1, 2, 4, 8, 16) if bq <= cap for s in (1, 2) for w in (None, 32)}
    assert set(seen) == want and n == len(want) == len(seen)
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_compiles_the_tables_launches_for_2_byte_dtypes(dtype, tmp_path, monkeypatch):
    """The warm-up adds the measured table's launches of the layout where they apply (2-byte
    inputs, triton_paged_attention), and only there."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter on CPU; the GPU tests cover the device")
    from adaspec.layers.attention import launch_table
    from adaspec.layers.attention import triton_kernels as tk

    t = launch_table.merge_entry({}, 4, 16, 1, 1, dict(block_q=1, block_n=16, num_warps=2, num_stages=2, num_splits=2))
    (tmp_path / "t.json").write_text(json.dumps(t))
    monkeypatch.setattr(launch_table, "TABLE_FILE", tmp_path / "t.json")
    launch_table.clear_cache()
    seen = []
    real = tk.triton_paged_attention

    def record(q, k, v, meta, scale, window=None, **kw):
        seen.append((meta.block_q, kw["block_n"]))
        return real(q, k, v, meta, scale, window, **kw)

    monkeypatch.setattr(tk, "triton_paged_attention", record)
    tk.warm_up(8, torch.zeros(64, 2, 16, dtype=dtype), torch.zeros(64, 2, 16, dtype=dtype),
               torch.zeros(3, 4, dtype=torch.int32), 16, dtype, {None})
    launch_table.clear_cache()
    assert ((1, 16) in seen) == (dtype == torch.bfloat16)
    assert (1, None) in seen


def test_choose_num_splits():
    pytest.importorskip("triton")
    from adaspec.layers.attention.triton_kernels import choose_num_splits

    cpu = torch.device("cpu")  # counts as an H200 (132 SMs)
    assert choose_num_splits(8, 4096, cpu) == 16      # b=1 decode, long context: fill the SMs
    assert choose_num_splits(8, 300, cpu) == 1        # too few keys to split
    assert choose_num_splits(2048, 4096, cpu) == 1    # the grid alone fills the GPU
    assert 1 < choose_num_splits(128, 4096, cpu) <= 4
    assert choose_num_splits(128, 4096, cpu, block_m=64) == 2   # heavy tiles: ~1 program per SM
    assert choose_num_splits(512, 4096, cpu, block_m=64) == 1


def test_token_graph_splits():
    """A token graph splits its keys as its rows alone would (its padding programs do nothing):
    a short prompt over a long context splits, a big chunk or a short context does not."""
    pytest.importorskip("triton")
    from adaspec.layers.attention import get_backend
    from adaspec.layers.attention.triton_kernels import token_graph_splits

    cpu = torch.device("cpu")
    assert token_graph_splits(16, 4, 4, 8, 32768, cpu) > 4     # 4 programs a KV head: split
    assert token_graph_splits(2048, 16, 4, 8, 32768, cpu) == 1   # 128 programs a KV head
    assert token_graph_splits(16, 4, 4, 8, 300, cpu) == 1       # too few keys to split
    assert get_backend("triton").graph_splits(16, 4, 4, 8, 32768, cpu) == token_graph_splits(16, 4, 4, 8, 32768, cpu)
    assert get_backend("torch").graph_splits(16, 4, 4, 8, 32768, cpu) is None


def test_bad_shapes_raise():
    b = make_batch([Req(prefix=2, q_len=1)], 4, 2, 8, 3, block_q=1)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        torch_paged_attention(b.q[:, :3], b.k_cache, b.v_cache, b.meta, 1.0)
    with pytest.raises(ValueError, match="store_kv"):
        torch_store_kv(b.k_cache, b.v_cache, b.new_k[:, :1], b.new_v, b.meta.slot_mapping)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_gpu_matches_reference(dtype):
    from adaspec.layers.attention.triton_kernels import triton_paged_attention

    b = make_batch(mixed(16) + [Req(prefix=600, q_len=1)], 32, 8, 128, 16, dtype=dtype, block_q=4)
    dev = torch.device("cuda")
    for name in ("q", "k_cache", "v_cache", "new_k", "new_v"):
        setattr(b, name, getattr(b, name).to(dev))
    b.meta = AttnMeta(**{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in vars(b.meta).items()})
    torch_store_kv(b.k_cache, b.v_cache, b.new_k, b.new_v, b.meta.slot_mapping)
    want = dense_reference(type(b)(**{**vars(b), "q": b.q.cpu()}), 128 ** -0.5)
    for splits in (1, 4):
        got = triton_paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 128 ** -0.5, num_splits=splits)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("n", [1, 16])
def test_measured_launch_matches_reference(n, tmp_path, monkeypatch):
    """(layers/attention/launch_table.py) The kernel run with the table's launch (block_q, key
    block, split-KV) gives the torch reference's output in bf16, and took that launch (the
    recorded kernel arguments); fp32 inputs take the heuristics' launch."""
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter on CPU; the GPU tests cover the device")
    from adaspec.layers.attention import launch_table
    from adaspec.layers.attention import triton_kernels as tk

    t = {}
    launch_table.merge_entry(t, 8, 16, 1, 1, dict(block_q=1, block_n=16, num_warps=4, num_stages=2, num_splits=3))
    launch_table.merge_entry(t, 8, 16, 1, 64, dict(block_q=1, block_n=32, num_warps=2, num_stages=3, num_splits=1))
    (tmp_path / "t.json").write_text(json.dumps(t))
    monkeypatch.setattr(launch_table, "TABLE_FILE", tmp_path / "t.json")
    launch_table.clear_cache()

    launches = []
    real = tk._paged_attn_kernel

    class Spy:
        def __getitem__(self, grid):
            def go(*args, **kw):
                launches.append((grid, kw["BLOCK_N"], kw["BLOCK_Q"]))
                return real[grid](*args, **kw)
            return go

    monkeypatch.setattr(tk, "_paged_attn_kernel", Spy())
    reqs = [Req(prefix=40 + 7 * i, q_len=1) for i in range(n)]
    bq = tk.choose_block_q(1, 8, n)
    b = make_batch(reqs, 8, 1, 16, 16, dtype=torch.bfloat16, block_q=bq)
    b.meta.max_ctx_len = 64 * 8
    check("triton", b, dtype=torch.bfloat16)
    want = launch_table.lookup(8, 16, 1, n)
    grid, bn, got_bq = launches[-1]
    assert (bn, got_bq, grid[2]) == (want["block_n"], want["block_q"], want["num_splits"])
    assert want["block_n"] == (16 if n == 1 else 32)
    # fp32 inputs keep the heuristics' launch (the table is measured in bf16)
    check("triton", make_batch(reqs, 8, 1, 16, 16, block_q=bq))
    assert launches[-1][1] == tk.launch_config(max(tk.MIN_BLOCK_M, bq * 8), 16)[0]
    launch_table.clear_cache()
