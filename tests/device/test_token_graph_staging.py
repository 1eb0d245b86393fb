"""A token graph's staging (`stage_forward` with a fixed `launch` plan, `ForwardInputs.pad_to`):
the step's own rows attend exactly as when staged alone, whatever the padding, and the padding
(a request owning the rows past the step's, requests of no rows, the launch plan's extra
programs) sees nothing and writes nothing. Run with the Triton kernel (under the interpreter
on CPU, compiled on a GPU) and the torch reference."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from adaspec.device.staging import FixedLaunch, Staging
from adaspec.engine.step_layout import ForwardInputs, stage_forward_inputs
from adaspec.layers.attention import get_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None
BS, HQ, HKV, D = 4, 4, 2, 16


TREE = [-1, 0, 0, 1, 2]   # a tree verify's nodes: parents (node 0: the root)


def _step(reqs):
    """ForwardInputs of requests given as (keys cached before, new rows, tree): a prefill chunk
    over its prefix, decodes, a fresh prompt, a tree verification (`TREE`'s nodes, as
    step_layout lays them out: a tree region after the prefix); request i's blocks are its
    own, 8 per request."""
    fi = ForwardInputs()
    for i, (cached, n, tree) in enumerate(reqs):
        rng = range(cached, cached + n)
        fi.ids += [3] * n
        fi.cache_index += list(rng)
        fi.slots += [(8 * i + p // BS) * BS + p % BS for p in rng]
        fi.q_lens.append(n)
        fi.ctx.append(cached + n)
        if tree:
            m = np.zeros((n, n), np.uint8)
            depth = []
            for j, p in enumerate(TREE):
                m[j] = m[p] if p >= 0 else 0
                m[j, j] = 1
                depth.append(int(m[j].sum()) - 1)
            fi.positions += [cached + d for d in depth]
            fi.mask_start.append(cached)
            fi.mask_offset.append(sum(len(x) for x in fi.mask))
            fi.mask.append(m.reshape(-1))
        else:
            fi.positions += list(rng)
            fi.mask_start.append(cached + n)
            fi.mask_offset.append(0)
    return fi


def _attend(backend_name, fi, launch, kv, q_rows, new_kv, n):
    """Stage `fi` (`n` real requests; the rest padding, mapped to the scratch row n) and run
    the store and attention: (out, k cache, v cache, meta)."""
    dev = kv[0].device
    backend = get_backend(backend_name)
    stg = Staging(1 << 16, dev)
    stg.begin()
    table = torch.arange(8 * (n + 1), dtype=torch.int32, device=dev).view(n + 1, 8)
    meta, _, _ = stage_forward_inputs(stg, backend, table, BS, HQ // HKV, fi, bool(fi.mask),
                                      [min(i, n) for i in range(len(fi.q_lens))], max_ctx_len=max(fi.ctx),
                                      launch=launch)
    stg.commit()
    k_cache, v_cache = (c.clone() for c in kv)
    q = torch.zeros(len(fi.ids), HQ, D, device=dev)
    q[:len(q_rows)] = q_rows
    k_new = torch.zeros(len(fi.ids), HKV, D, device=dev)
    v_new = torch.zeros_like(k_new)
    k_new[:len(q_rows)], v_new[:len(q_rows)] = new_kv
    if backend_name == "triton":
        from adaspec.layers.attention.triton_kernels import triton_store_kv as store
    else:
        from adaspec.layers.attention.torch_ref import torch_store_kv as store
    store(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, meta, D ** -0.5, None)
    return out, k_cache, v_cache, meta


@pytest.mark.parametrize("backend,splits", [("torch", None)] + [pytest.param(
    "triton", s, marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")) for s in (1, 3)])
def test_token_graph_padding_changes_no_real_row(backend, splits, monkeypatch):
    reduces = []
    if backend == "triton":   # spy on the split reduction: the launch's split-KV factor is the meta's
        from adaspec.layers.attention import triton_kernels as tk

        real = tk._split_reduce_kernel

        class Spy:
            def __getitem__(self, grid):
                reduces.append(grid)
                return real[grid]

        monkeypatch.setattr(tk, "_split_reduce_kernel", Spy())
    dev = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(3)
    # decodes around a prefill chunk, a tree verification and a fresh prompt
    reqs = [(9, 1, False), (5, 11, False), (13, 1, False), (6, len(TREE), True), (0, 6, False), (2, 1, False)]
    n, T = len(reqs), sum(r for _, r, _ in reqs)
    slots = 8 * (n + 1) * BS
    # cached keys of every block (garbage in the scratch block: padding must never read it)
    kv = [torch.randn(slots, HKV, D, generator=g).to(dev) for _ in range(2)]
    for c in kv:
        c[8 * n * BS:] = float("nan")
    q_rows = torch.randn(T, HQ, D, generator=g).to(dev)
    new_kv = (torch.randn(T, HKV, D, generator=g).to(dev), torch.randn(T, HKV, D, generator=g).to(dev))

    ref, k_ref, v_ref, _ = _attend(backend, _step(reqs), None, kv, q_rows, new_kv, n)
    rows, slots_n = 64, n + 3                      # a token graph of 64 rows
    fi = _step(reqs)
    fi.pad_to(rows, slots_n)
    assert fi.q_lens == [r for _, r, _ in reqs] + [rows - T, 0, 0] and len(fi.ids) == rows
    bq = get_backend(backend).block_q(rows, HQ // HKV, slots_n)
    # (Triton: the split-KV factor the launch fixes, and the reduction of the splits)
    launch = FixedLaunch(bq, -(-rows // bq) + slots_n, 4 * len(TREE) ** 2, splits)
    out, k_got, v_got, meta = _attend(backend, fi, launch, kv, q_rows, new_kv, n)
    assert meta.prog_req.shape[0] == launch.programs and int(meta.prog_req[-1]) == slots_n - 1
    assert meta.mask.numel() == launch.mask_room and meta.num_splits == splits
    assert bool(reduces) == (splits is not None and splits > 1), reduces
    torch.testing.assert_close(out[:T], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))          # the padding rows see nothing
    for got, want in ((k_got, k_ref), (v_got, v_ref)):                  # ... and write nothing (scratch: NaN)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_pad_to_refuses_what_does_not_fit():
    fi = _step([(0, 10, False), (4, 1, False)])
    with pytest.raises(ValueError, match="does not fit a token graph of 8 rows"):
        fi.pad_to(8, 6)
    with pytest.raises(ValueError, match="does not fit"):
        _step([(0, 10, False), (4, 1, False)]).pad_to(16, 3)   # no slot left for the empty request
    fi = _step([(0, 10, False), (4, 1, False)])
    fi.pad_to(11, 4)                               # an exact fit: the padding request owns no row
    assert fi.q_lens == [10, 1, 0, 0] and fi.ctx == [10, 5, 0, 0] and fi.slots[11:] == []


def test_fixed_launch_refuses_more_than_it_holds():
    from adaspec.layers.attention import get_backend as gb

    fi = _step([(0, 10, False), (6, len(TREE), True)])
    fi.pad_to(32, 4)
    stg = Staging(1 << 16, torch.device("cpu"))
    stg.begin()
    table = torch.zeros(3, 8, dtype=torch.int32)
    for launch in (FixedLaunch(1, 20, 64), FixedLaunch(1, 40, 8)):   # too few programs; too little mask room
        with pytest.raises(ValueError, match="do not fit a fixed launch"):
            stage_forward_inputs(stg, gb("torch"), table, BS, 2, fi, True, [0, 1, 2, 2], max_ctx_len=16,
                                 launch=launch)


def test_max_programs_bounds_every_plan():
    """A token graph's launch plan is padded to `max_programs`: no mix of at most `slots`
    requests over `rows` rows may need more, at any block_q."""
    import random

    from adaspec.device.staging import max_programs
    from adaspec.layers.attention.meta import launch_plan

    rng = random.Random(0)
    for _ in range(2000):
        rows, slots, bq = rng.choice([16, 64, 192, 1024]), rng.randint(3, 40), rng.choice([1, 2, 4, 8, 16])
        q = [0] * rng.randint(1, slots - 2)
        for _ in range(rows):   # every row to some request (a prompt, decodes, a padding request's rest)
            q[rng.randrange(len(q))] += 1 if rng.random() < 0.9 else 0
        q.append(rows - sum(q))
        q += [0] * (slots - len(q))
        assert len(launch_plan(q, bq)[0]) <= max_programs(rows, slots, bq), (rows, slots, bq, q)
    assert max_programs(16, 258, 16) == 17 and max_programs(2048, 258, 16) == 128 + 258
