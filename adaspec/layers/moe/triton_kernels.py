"""Fused-MoE experts in Triton, two paths picked by the number of (token, slot) pairs N = T*k.

Aligned path (large N): device-side alignment, grouped gate/up GEMM with SiLU-and-mul, grouped
down GEMM with the routing weight, and the top-k reduction.

    align     (align.py) every expert's (token, slot) pairs in rows padded to BLOCK_M, and
              for every padded block its expert and valid row count; fixed maximum sizes,
              no host sync: CUDA graphs capture it.
    gate_up   grid (block, I tile): the block's rows of x times w13[e] (gate and up tiles),
              silu(gate) * up -> inter[T*k, I] indexed by pair (HF's rounding steps).
    down      grid (block, H tile): inter rows times w2[e], times the pair's routing weight
              -> out_k[T*k, H]; blocks past the last expert exit at once.
              (Either GEMM's grid may put its N tiles first: `_grid`, a launch-table key.)
    reduce    out[t] = sum_j out_k[t*k + j] (torch's sum: fp32 accumulation, one rounding).

Small path (`use_small_path`: decode-sized N; small_batch.py): two launches, no alignment: a
gate/up GEMV per pair reading its expert straight from the ids, and a down kernel per (token,
H tile) that holds the token's k slots in one tile and sums them, so the align and reduce
launches are gone.

Rounding contract (both paths, any float dtype ty): gate and up round to ty, silu rounds, the
product rounds (HF's steps); the down product rounds to ty, times the weight (rounded to ty
first if round_weights) rounds to ty; the k terms are summed in fp32 and rounded to ty once.
The two paths differ only in the order of fp32 sums (inside a dot, and of the k terms), as two
launch configurations of one path do: in bf16/fp16 they agree bit for bit except where that
order moves an fp32 value across a rounding boundary (rare); in fp32, to fp32 rounding.

Weights keep Hugging Face's layout: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], so
tiles of B are read as [BLOCK_K, BLOCK_N] with a strided K (as vLLM's kernel does), and the
small path's GEMV tiles as [BLOCK_N, BLOCK_K] rows with a contiguous K.
Launch parameters come from `launch_config(num_pairs, ...)`: a measured table per batch
bucket and path (moe_configs.json next to this file, written by benchmarks/kernels/moe_sweep.py;
key "E{E}_H{H}_I{I}" for the aligned path, that key + "_small" for the small one) or defaults.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from adaspec.layers.fused_ops import _next_pow2, triton
from adaspec.layers.moe.align import ONE_PROGRAM_MAX_PAIRS, align
from adaspec.layers.moe.small_batch import experts_small
from adaspec.layers import pdl

if triton is not None:
    import triton.language as tl

    from adaspec.layers.pdl import gdc_enter

CONFIG_FILE = Path(__file__).with_name("moe_configs.json")
# A table's last bucket: every larger number of pairs.
OPEN_BUCKET = 1 << 62


def table_key(E: int, H: int, I: int, small: bool = False) -> str:
    """The launch table's key for one expert shape and path (moe_configs.json; the sweep writes
    what `launch_config` reads)."""
    return f"E{E}_H{H}_I{I}" + ("_small" if small else "")


# Used where the sweep wrote nothing: small blocks for decode (few rows per expert), larger for prefill.
DEFAULT_CONFIGS = {
    64: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    1024: {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    OPEN_BUCKET: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
}
# The small path's (unmeasured) default: BLOCK_N/BLOCK_K the gate/up GEMV tile, DOWN_* the down
# kernel's per-slot tile. Narrow N tiles because at T = 1 the grid is all the parallelism there
# is: 8 pairs x 768/16 gate/up programs and 2048/8 down programs at the Qwen3-30B-A3B shape.
DEFAULT_SMALL_CONFIGS = {
    OPEN_BUCKET: {"BLOCK_N": 16, "BLOCK_K": 256, "DOWN_BLOCK_N": 8, "DOWN_BLOCK_K": 128, "num_warps": 4,
                  "num_stages": 3},
}

# The small path takes N = T*k <= 64 pairs (decode up to b = 8 at top-8, b = 2 verification at
# q = 4), and with more than one token only N <= E/2. Why: it saves the align and reduce
# launches (~12 us a layer measured at b = 1 on the H200, 0.37 + 0.22 ms per 48-layer step)
# but reads an expert once per pair, not once per batch. One token never repeats an expert;
# with uniform routing N pairs touch E(1 - (1 - 1/E)^N) experts, so N <= E/2 bounds the
# repeats at 27% of the bytes (E = 128: 0.2 / 3.6 / 13.5 repeated experts at N = 8 / 32 / 64,
# i.e. 0.4 / 7 / 27 us at 4.8 TB/s if none came from L2). Repeats mostly do come from
# L2: the grids put the pair (or token) index fastest, so the programs reading one expert's
# same tile run side by side. But at 64 pairs the saving already depends on that (27 > 12 us),
# so no higher limit without a measurement (benchmarks/kernels/moe_sweep.py times both paths).
SMALL_MAX_PAIRS = 64


def use_small_path(T: int, k: int, E: int) -> bool:
    """Whether `fused_experts_triton` takes the small path for T tokens, top-k, E experts."""
    return T * k <= SMALL_MAX_PAIRS and (T == 1 or T * k <= E // 2)


@lru_cache(maxsize=None)
def _table(key: str) -> dict[int, dict]:
    """{max pairs of the bucket: config} for one weight shape key ("E{E}_H{H}_I{I}", or with
    "_small" the small path's), else the defaults."""
    if CONFIG_FILE.exists():
        table = json.loads(CONFIG_FILE.read_text()).get(key)
        if table:
            return {int(b): c for b, c in table.items()}
    return DEFAULT_SMALL_CONFIGS if key.endswith("_small") else DEFAULT_CONFIGS


# Shared memory a launch may plan for its pipelined tiles: below the H100/H200's 227 KiB per
# block, leaving room for what Triton adds (layout conversions, the epilogue).
SMEM_BUDGET = 160 * 1024


def fit_shared_memory(cfg: dict, elem_bytes: int) -> dict:
    """`cfg` with its pipelined tiles (num_stages x (BLOCK_M x BLOCK_K + BLOCK_K x BLOCK_N)
    elements) within SMEM_BUDGET for this element size: the sweep measures bf16, and the same
    tiles in fp32 take twice the memory (a launch that does not fit fails to compile). Drops a
    stage first (down to 2), then halves BLOCK_K (down to 32), then BLOCK_N (down to 16)."""
    c = dict(cfg)
    c.setdefault("num_stages", 3)

    def need(c):
        return c["num_stages"] * (c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"]) * elem_bytes

    while need(c) > SMEM_BUDGET:
        if c["num_stages"] > 2:
            c["num_stages"] -= 1
        elif c["BLOCK_K"] > 32:
            c["BLOCK_K"] //= 2
        elif c["BLOCK_N"] > 16:
            c["BLOCK_N"] //= 2
        else:
            break
    return c


def fit_small(cfg: dict, top_k: int, elem_bytes: int) -> dict:
    """A small-path `cfg` whose fp32 accumulators fit 64 registers a thread (gate/up: 2 x
    BLOCK_N x BLOCK_K; down: KP x DOWN_BLOCK_N x DOWN_BLOCK_K, KP = top_k rounded up to a power
    of two) and whose pipelined loads (num_stages x one loop step's tile) fit SMEM_BUDGET:
    halves the K block (down to 16), then the N block (down to 8)."""
    c = {"num_warps": 4, "num_stages": 3, **cfg}
    regs = 64 * 32 * c["num_warps"]
    for rows, nk, kk in ((2, "BLOCK_N", "BLOCK_K"), (_next_pow2(top_k), "DOWN_BLOCK_N", "DOWN_BLOCK_K")):
        while rows * c[nk] * c[kk] > regs or c["num_stages"] * rows * c[nk] * c[kk] * elem_bytes > SMEM_BUDGET:
            if c[kk] > 16:
                c[kk] //= 2
            elif c[nk] > 8:
                c[nk] //= 2
            else:
                break
    return c


def launch_config(num_pairs: int, E: int, H: int, I: int, elem_bytes: int = 2, small_top_k: int = 0) -> dict:
    """The launch parameters for `num_pairs` = T * top_k (token, expert) pairs: the smallest
    bucket holding it, of the measured table for this (E, H, I) if there is one, fitted to the
    shared memory for `elem_bytes`-byte elements. `small_top_k` > 0: the small path's table,
    fitted by `fit_small` for that top-k."""
    table = _table(table_key(E, H, I, small=bool(small_top_k)))
    cfg = next((table[b] for b in sorted(table) if num_pairs <= b), table[max(table)])
    if small_top_k:
        return fit_small(cfg, small_top_k, elem_bytes)
    fitted = fit_shared_memory(cfg, elem_bytes)
    if any(k.startswith(("DOWN_", "down_")) for k in cfg):   # the down GEMM's own launch, fitted alike
        d = fit_shared_memory(down_launch(cfg), elem_bytes)
        fitted.update(DOWN_BLOCK_N=d["BLOCK_N"], DOWN_BLOCK_K=d["BLOCK_K"], down_num_warps=d["num_warps"],
                      down_num_stages=d["num_stages"])
    return fitted


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, H, I,
                        stride_x, stride_we, stride_wn, stride_o, TOPK: tl.constexpr, IEEE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_FIRST: tl.constexpr = False):
        pid_m = tl.program_id(1 if N_FIRST else 0)
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        r = tl.arange(0, BM)
        r_ok = r < tl.load(block_rows_ptr + pid_m)
        pair = tl.load(sorted_ptr + pid_m * BM + r, mask=r_ok, other=0).to(tl.int64)
        tok = pair // TOPK
        n = tl.program_id(0 if N_FIRST else 1) * BN + tl.arange(0, BN)
        n_ok = n < I
        w_base = w_ptr + e * stride_we
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (n[None, :] + I).to(tl.int64) * stride_wn + kk[:, None], mask=wmask, other=0.0)
            if IEEE:
                acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
        ty = out_ptr.dtype.element_ty
        # HF: gate and up round to the dtype, silu rounds, then the product does.
        g = acc_g.to(ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32) * acc_u.to(ty).to(tl.float32)
        tl.store(out_ptr + pair[:, None] * stride_o + n[None, :], act.to(ty), mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, out_ptr, topw_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, H, I,
                     stride_a, stride_we, stride_wn, stride_o, IEEE: tl.constexpr, ROUND_W: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_FIRST: tl.constexpr = False):
        pid_m = tl.program_id(1 if N_FIRST else 0)
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        r = tl.arange(0, BM)
        r_ok = r < tl.load(block_rows_ptr + pid_m)
        pair = tl.load(sorted_ptr + pid_m * BM + r, mask=r_ok, other=0).to(tl.int64)
        n = tl.program_id(0 if N_FIRST else 1) * BN + tl.arange(0, BN)
        n_ok = n < H
        w_base = w_ptr + e * stride_we
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < I
            a = tl.load(a_ptr + pair[:, None] * stride_a + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        ty = out_ptr.dtype.element_ty
        weight = tl.load(topw_ptr + pair, mask=r_ok, other=0.0)
        if ROUND_W:   # the router's weight rounded to the model dtype first (Qwen)
            weight = weight.to(ty)
        weight = weight.to(tl.float32)
        y = acc.to(ty).to(tl.float32) * weight[:, None]   # HF: the expert output rounds, then * weight
        tl.store(out_ptr + pair[:, None] * stride_o + n[None, :], y.to(ty), mask=r_ok[:, None] & n_ok[None, :])


if triton is not None:

    @triton.jit
    def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, K: tl.constexpr, K_PAD: tl.constexpr,
                             E_PAD: tl.constexpr, RENORM: tl.constexpr, USE_GDC: tl.constexpr = False):
        """One token per program: softmax over E logits, top-K by repeated argmax (lowest id
        first among ties), optional renormalisation; weights fp32, ids int64."""
        gdc_enter(USE_GDC)   # programmatic dependent launch (layers/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + row * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e < E, p, -1.0)
        j = tl.arange(0, K_PAD)
        w = tl.zeros([K_PAD], dtype=tl.float32)
        ids = tl.zeros([K_PAD], dtype=tl.int64)
        for i in tl.static_range(K):
            v = tl.max(p, axis=0)
            at = tl.min(tl.where(p == v, e, E_PAD), axis=0)
            w = tl.where(j == i, v, w)
            ids = tl.where(j == i, at.to(tl.int64), ids)
            p = tl.where(e == at, -1.0, p)
        if RENORM:
            w = w / tl.sum(tl.where(j < K, w, 0.0), axis=0)
        tl.store(w_ptr + row * K + j, w, mask=j < K)
        tl.store(ids_ptr + row * K + j, ids, mask=j < K)


def softmax_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.softmax_topk in one launch (no scaling): (weights fp32 [T, k], ids int64 [T, k])."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        _softmax_topk_kernel[(T,)](logits, w, ids, E, logits.stride(0), K=top_k, K_PAD=max(_next_pow2(top_k), 2),
                                   E_PAD=max(_next_pow2(E), 16), RENORM=renormalize, num_warps=1 if E <= 256 else 4,
                                   **pdl.launch_kw(logits))
    return w, ids


def plan(T: int, k: int, E: int, H: int, I: int, elem_bytes: int, path: str | None = None) -> tuple[str, dict]:
    """(path, launch config) that `fused_experts_triton` uses for T tokens of top-k routing over
    E experts of this shape; `path` forces "small" or "aligned"."""
    path = path or ("small" if use_small_path(T, k, E) else "aligned")
    if path not in ("small", "aligned"):
        raise ValueError(f"fused_experts: path {path!r} is not 'small' or 'aligned'")
    return path, launch_config(T * k, E, H, I, elem_bytes, small_top_k=k if path == "small" else 0)


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, config: dict | None = None, round_weights: bool = False,
                         path: str | None = None, routed_experts: int | None = None) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts_ref (with `round_weights` as in
    layers.moe.fused_experts), rounding as the module docstring states. `path` = "small" or
    "aligned" forces a path (tests, benchmarks), else `use_small_path` picks by size; `config`
    overrides that path's `launch_config`. Sizes depend on shapes only: CUDA graphs capture it.

    `routed_experts` (expert parallelism): the experts the router chose among, more than w13
    holds. ids may then hold -1 (slots whose expert is on another rank), so the aligned path's
    per-slot rows start at zero (no kernel writes theirs); and the path and launch are planned
    for the whole layer's shape, whose rows per expert this rank's share has, so its measured
    table applies."""
    T, H = x.shape
    k = ids.shape[1]
    E, I2, _ = w13.shape
    I = I2 // 2
    if T == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts: x, w13 and w2 need contiguous last dims")
    N = T * k
    path, cfg = plan(T, k, routed_experts or E, H, I, x.element_size(), path)
    cfg = config or cfg
    weights = weights.reshape(-1).contiguous()
    inter = torch.empty(N, I, dtype=x.dtype, device=x.device)
    if path == "small":
        return experts_small(x, w13, w2, weights, ids.reshape(-1).contiguous(), inter, cfg, round_weights)
    aligned = align(ids, E, cfg["BLOCK_M"])
    gate_up_aligned(x, w13, inter, aligned, k, cfg)
    out_k = down_aligned(inter, w2, weights, aligned, cfg, round_weights, skips=routed_experts is not None)
    return out_k.view(T, k, H).sum(dim=1) if k > 1 else out_k.view(T, H)


def down_launch(cfg: dict) -> dict:
    """The down GEMM's launch in an aligned-path config: its own DOWN_BLOCK_N / DOWN_BLOCK_K /
    down_num_warps / down_num_stages / DOWN_N_FIRST where the sweep found them, else gate/up's
    (BLOCK_M is shared: the alignment's blocks)."""
    return {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg.get("DOWN_BLOCK_N", cfg["BLOCK_N"]),
            "BLOCK_K": cfg.get("DOWN_BLOCK_K", cfg["BLOCK_K"]),
            "num_warps": cfg.get("down_num_warps", cfg.get("num_warps", 4)),
            "num_stages": cfg.get("down_num_stages", cfg.get("num_stages", 3)),
            "N_FIRST": cfg.get("DOWN_N_FIRST", cfg.get("N_FIRST", 0))}


# CUDA's limit on a grid's second and third dimensions.
MAX_GRID_YZ = 65535


def _grid(blocks: int, n_tiles: int, n_first) -> tuple[tuple[int, int], bool]:
    """(grid, N_FIRST) of an aligned GEMM. Blocks first (the default): programs that run side
    by side read one N tile of many experts. N_FIRST (a launch-table key, "N_FIRST" for gate/up,
    "DOWN_N_FIRST" for down): programs that run side by side read every N tile of one block, so
    the block's rows of activations, read once per N tile, come from L2 after the first. Which
    is faster is the sweep's to measure. N_FIRST falls back to blocks first when there are more
    blocks than a grid's second dimension holds."""
    if n_first and blocks <= MAX_GRID_YZ:
        return (n_tiles, blocks), True
    return (blocks, n_tiles), False


def gate_up_aligned(x: torch.Tensor, w13: torch.Tensor, inter: torch.Tensor, aligned: tuple, top_k: int,
                    cfg: dict) -> None:
    """inter[pair] = silu(x[tok] @ gate[e].T) * (x[tok] @ up[e].T) for the aligned pairs."""
    sorted_pairs, block_expert, block_rows = aligned
    H, I = x.shape[1], inter.shape[1]
    grid, n_first = _grid(block_expert.numel(), triton.cdiv(I, cfg["BLOCK_N"]), cfg.get("N_FIRST", 0))
    _gate_up_kernel[grid](
        x, w13, inter, sorted_pairs, block_expert, block_rows, H, I, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOPK=top_k, IEEE=x.dtype == torch.float32, BM=cfg["BLOCK_M"], BN=cfg["BLOCK_N"],
        BK=cfg["BLOCK_K"], N_FIRST=n_first, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))


def down_aligned(inter: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, aligned: tuple, cfg: dict,
                 round_weights: bool, skips: bool = False) -> torch.Tensor:
    """out_k [T*k, H]: each aligned pair's inter row times w2[e], times its routing weight;
    with `skips`, zeros in the rows of pairs the alignment left out (id -1)."""
    sorted_pairs, block_expert, block_rows = aligned
    N, I = inter.shape
    H = w2.shape[1]
    d = down_launch(cfg)
    out_k = (torch.zeros if skips else torch.empty)(N, H, dtype=inter.dtype, device=inter.device)
    grid, n_first = _grid(block_expert.numel(), triton.cdiv(H, d["BLOCK_N"]), d["N_FIRST"])
    _down_kernel[grid](
        inter, w2, out_k, weights, sorted_pairs, block_expert, block_rows, H, I,
        inter.stride(0), w2.stride(0), w2.stride(1), out_k.stride(0), IEEE=inter.dtype == torch.float32,
        ROUND_W=round_weights, BM=d["BLOCK_M"], BN=d["BLOCK_N"], BK=d["BLOCK_K"], N_FIRST=n_first,
        num_warps=d["num_warps"], num_stages=d["num_stages"])
    return out_k


#: Pairs warm_up covers when it is not told the largest step (max_tokens).
WARM_UP_MAX_PAIRS = 8192


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype, round_weights: bool = False,
            max_tokens: int | None = None, routed_experts: int | None = None) -> int:
    """Compile every launch the dispatch picks for these expert weights for 1..max_tokens tokens
    (the largest step the engine runs: its max_num_batched_tokens; None: WARM_UP_MAX_PAIRS
    pairs), both paths and alignments, every bucket of their tables, so no JIT compile
    happens while serving (a prefill chunk past the warmed buckets compiled for seconds in the
    middle of a served run): one call per distinct (path, alignment, launch config), since no
    kernel argument specialises on T. `round_weights` and `routed_experts` (expert parallelism:
    the plans of the whole layer's shape) as the model calls it. Returns the number of calls."""
    E, I2, H = w13.shape
    dev = w13.device
    elem_bytes = torch.empty(0, dtype=dtype).element_size()
    done = set()
    for T in range(1, (max_tokens or max(1, WARM_UP_MAX_PAIRS // top_k)) + 1):
        path, cfg = plan(T, top_k, routed_experts or E, H, I2 // 2, elem_bytes)
        key = (path, T * top_k > ONE_PROGRAM_MAX_PAIRS, tuple(sorted(cfg.items())))   # both alignments too
        if key in done:
            continue
        done.add(key)
        x = torch.zeros(T, H, dtype=dtype, device=dev)
        ids = (torch.arange(T * top_k, device=dev) % E).view(T, top_k)
        fused_experts_triton(x, w13, w2, torch.ones(T, top_k, dtype=torch.float32, device=dev), ids,
                             round_weights=round_weights, routed_experts=routed_experts)
    return len(done)
