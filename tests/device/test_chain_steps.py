"""Chain draft steps worked out on the device (`device.chain_steps`): every metadata field of
every step against the layout written out by hand, through the PyTorch ops and the Triton
kernel (the interpreter on CPU), and the drafts' scatter into the staging buffer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspec.device.chain_steps import DEVICE_TOKEN, INPUTS, REAL, SHIFTED, ChainSteps
from adaspec.device.staging import Staging
from adaspec.layers.attention import get_backend
from helpers import kernel_path

BS = 4


def _setup(max_batch: int, max_k: int):
    table = torch.tensor([[3, 7, 5, 2, 9, 4], [8, 1, 6, 0, 11, 10], [12, 13, 14, 15, 16, 17], [0] * 6],
                         dtype=torch.int32)
    last_count = torch.tensor([1, 3, 2, 1])
    last_token = torch.tensor([500, 501, 502, 503])
    hidden = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    stg = Staging(1 << 14, torch.device("cpu"))
    cs = ChainSteps(max_batch, max_k, get_backend("torch"), 1, BS, table, last_count, last_token, hidden, stg)
    return cs, stg, table, hidden


def _stage(stg, K, rows, ns, depths, tokens, flags, pad=0, pad_row=3):
    """Stage (begun and committed) with each request's drafts routed to a field of its own."""
    stg.begin()
    B = len(rows)
    ids_h, ids = stg.reserve((max(B, 1), K + 1), torch.int64)
    tok_h, tok = stg.reserve((max(B, 1), K + 1), torch.int64)
    ids_h[...] = tok_h[...] = -7
    k = np.arange(1, K + 1)
    dst_ids = ids.start // 8 + np.arange(B)[:, None] * (K + 1) + k
    dst_tok = tok.start // 8 + np.arange(B)[:, None] * (K + 1) + k
    ref, _ = ChainSteps.stage(stg, K, rows, ns, depths, tokens, flags, dst_ids, dst_tok, pad, pad_row)
    stg.commit()
    return ref, ids, tok


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_steps_are_derived_from_row_length_depth_and_the_step_in_flight(path, monkeypatch):
    kernel_path(path, monkeypatch)
    cs, stg, table, hidden = _setup(6, 4)
    K = 3
    # row 0: on the host, full depth; row 1: shifted (its step in flight emitted 3: +2) with its
    # root on the device; row 2: depth 1, root on the device but not shifted; then one padding
    # request (on the pad row 3).
    ref, _, _ = _stage(stg, K, rows=[0, 1, 2], ns=[6, 9, 4], depths=[3, 3, 1], tokens=[40, 0, 0],
                       flags=[REAL, REAL | SHIFTED | DEVICE_TOKEN, REAL | DEVICE_TOKEN], pad=1)
    cs.load(ref)
    assert cs.inputs(K, 4).shape == (INPUTS + 2 * K, 4) and torch.equal(cs.inputs(K, 4), ref.t)
    h0, tok0 = cs.derive(K, 4)

    def slot(row, c):
        return int(table[row, c // BS]) * BS + c % BS

    n_eff = [6, 11, 4, 2]
    steps = cs.steps(4, K, 32)
    assert len(steps) == K
    for i, (meta, pos) in enumerate(steps):
        c = [n - 1 + i for n in n_eff]
        assert pos.tolist() == [x - 1 for x in c] and meta.positions.data_ptr() == pos.data_ptr()
        assert meta.cache_index.tolist() == c
        assert meta.ctx_len.tolist() == [c[0] + 1, c[1] + 1, c[2] + 1, 0]
        assert meta.mask_start.tolist() == meta.ctx_len.tolist()   # no tree region
        assert meta.slot_mapping.tolist() == [slot(0, c[0]), slot(1, c[1]), slot(2, c[2]) if i < 1 else -1, -1]
        assert meta.kv_start.tolist() == [1] * 4 and meta.req_row.tolist() == [0, 1, 2, 3]
        assert meta.query_start.tolist() == [0, 1, 2, 3, 4]
        assert meta.prog_req.tolist() == [0, 1, 2, 3] and meta.prog_q0.tolist() == [0] * 4
        assert meta.mask_offset.tolist() == [0] * 4 and meta.max_ctx_len == 32 and meta.block_q == 1
    assert tok0.tolist() == [40, 501, 502, 0]
    assert torch.equal(h0, hidden[[0, 1, 2, 3]])


def test_drafts_land_where_the_step_reads_them_and_padding_nowhere(monkeypatch):
    kernel_path("torch", monkeypatch)
    cs, stg, _, _ = _setup(4, 3)
    K = 2
    ref, ids, tok = _stage(stg, K, rows=[0, 2], ns=[6, 4], depths=[2, 2], tokens=[1, 2], flags=[REAL, REAL], pad=2)
    cs.load(ref)
    before = stg.dev.clone()
    drafts = torch.tensor([[11, 12], [21, 22], [91, 92], [93, 94]])
    cs.scatter(drafts)
    assert ids.t.tolist() == [[-7, 11, 12], [-7, 21, 22]]
    assert tok.t.tolist() == [[-7, 11, 12], [-7, 21, 22]]
    # Padding wrote only its sink, the element after the inputs.
    changed = (stg.dev.view(torch.int64) != before.view(torch.int64)).nonzero().view(-1).tolist()
    sink = (ref.start + ref.size * 8 + 15) // 16 * 2
    assert sorted(changed) == sorted([e for e in (ids.start // 8 + np.array([1, 2, 4, 5])).tolist()]
                                     + (tok.start // 8 + np.array([1, 2, 4, 5])).tolist() + [sink])


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_a_smaller_batch_leaves_the_rest_and_fits_bounds(path, monkeypatch):
    kernel_path(path, monkeypatch)
    cs, stg, _, _ = _setup(2, 2)
    cs.load(_stage(stg, 2, [1, 0], [5, 5], [2, 2], [7, 8], [REAL, REAL])[0])
    cs.derive(2, 2)
    cs.load(_stage(stg, 1, [2], [3], [1], [9], [REAL])[0])
    cs.derive(1, 1)
    (meta, _), = cs.steps(1, 1, 8)
    assert meta.cache_index.tolist() == [2] and cs.ci[0, 1].item() == 4   # request 2 of the first call stays
    assert cs.tok0.tolist() == [9, 8]
    with pytest.raises(ValueError, match="outside"):
        cs.derive(1, 3)
    with pytest.raises(ValueError, match="outside"):
        cs.derive(3, 1)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_the_packed_shift_loaded_with_the_inputs_is_applied_where_a_graph_finds_it(path, monkeypatch):
    """A draft graph applies the step's in-flight shift from the static copy: the same
    corrections as the shift applied eagerly, and an empty shift changes nothing."""
    kernel_path(path, monkeypatch)
    from adaspec.device.shift import Shift

    out = []
    for in_graph in (False, True):
        cs, stg, table, _ = _setup(4, 2)
        last_count = cs.last_count
        stg.begin()
        pos = stg.add([5, 9, 13], torch.int64)
        ci = stg.add([6, 10, 14], torch.int32)
        slots = stg.add([3, -1, 7], torch.int64)
        sh = Shift(stg)
        sh.add(pos, [0, 1, 2], [1, 1, 2])
        sh.add(ci, [0, 2], [1, 2])
        sh.add_slots(slots, [0, 1, 2], [6, 10, 14], [1, 1, 2])
        ref, packed = ChainSteps.stage(stg, 2, [0], [6], [2], [1], [REAL], [[0, 0]], [[0, 0]], 1, 3,
                                       sh if in_graph else None)
        eager = None if in_graph else sh.stage(stg)
        stg.commit()
        cs.load(ref, packed)
        if in_graph:
            cs.apply_shift(2, 2)
        else:
            sh.apply(eager, last_count, table, BS)
        out.append((pos.t.tolist(), ci.t.tolist(), slots.t.tolist()))
    assert out[0] == out[1]
    assert out[0][0] == [7, 11, 14] and out[0][1] == [8, 10, 15]   # rows 1 (+2) and 2 (+1)
    assert out[0][2][1] == -1 and out[0][2][0] == int(table[1, 8 // BS]) * BS + 8 % BS
    # An empty shift staged for a graph step moves nothing.
    cs, stg, _, _ = _setup(4, 2)
    stg.begin()
    pos = stg.add([5, 9], torch.int64)
    ref, packed = ChainSteps.stage(stg, 2, [0], [6], [2], [1], [REAL], [[0, 0]], [[0, 0]], 1, 3, Shift(stg))
    stg.commit()
    cs.load(ref, packed)
    cs.apply_shift(2, 2)
    assert pos.t.tolist() == [5, 9]
