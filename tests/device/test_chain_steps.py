"""Chain draft steps' metadata derived on the device (`device.chain_steps`): every field of
every step against the layout written out by hand, through the PyTorch ops and the Triton
kernel (the interpreter on CPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from adaspec.device.chain_steps import DEVICE_TOKEN, REAL, SHIFTED, ChainSteps
from adaspec.device.staging import Staging
from adaspec.layers.attention import get_backend

BS = 4


def _path(path, monkeypatch):
    if path == "triton":
        if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
            pytest.skip("the Triton path runs here only under the CPU interpreter")
        monkeypatch.setenv("ADASPEC_TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("ADASPEC_TRITON_INTERPRET", raising=False)


def _rows():
    table = torch.tensor([[3, 7, 5, 2, 9, 4], [8, 1, 6, 0, 11, 10], [12, 13, 14, 15, 16, 17], [0] * 6],
                         dtype=torch.int32)
    last_count = torch.tensor([1, 3, 2, 1])
    last_token = torch.tensor([500, 501, 502, 503])
    hidden = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    return table, last_count, last_token, hidden


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_steps_are_derived_from_row_length_depth_and_the_step_in_flight(path, monkeypatch):
    _path(path, monkeypatch)
    table, last_count, last_token, hidden = _rows()
    cs = ChainSteps(6, 4, get_backend("torch"), 1, BS, table, last_count, last_token, hidden)
    stg = Staging(1 << 14, torch.device("cpu"))
    K = 3
    # row 0: on the host, full depth; row 1: shifted (its step in flight emitted 3: +2) with its
    # root on the device; row 2: depth 1, root on the device but not shifted; then padding (row 3).
    inputs = ChainSteps.stage(stg, rows=[0, 1, 2, 3], ns=[6, 9, 4, 2], depths=[3, 3, 1, 0], tokens=[40, 0, 0, 0],
                              flags=[REAL, REAL | SHIFTED | DEVICE_TOKEN, REAL | DEVICE_TOKEN, 0])
    h0, tok0 = cs.derive(inputs.t, K)

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


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_a_smaller_batch_leaves_the_rest_and_fits_bounds(path, monkeypatch):
    _path(path, monkeypatch)
    table, last_count, last_token, hidden = _rows()
    cs = ChainSteps(2, 2, get_backend("torch"), 1, BS, table, last_count, last_token, hidden)
    stg = Staging(1 << 14, torch.device("cpu"))
    cs.derive(ChainSteps.stage(stg, [1, 0], [5, 5], [2, 2], [7, 8], [REAL, REAL]).t, 2)
    cs.derive(ChainSteps.stage(stg, [2], [3], [1], [9], [REAL]).t, 1)
    (meta, _), = cs.steps(1, 1, 8)
    assert meta.cache_index.tolist() == [2] and cs.ci[0, 1].item() == 4   # request 2 of the first call stays
    assert cs.tok0.tolist() == [9, 8]
    with pytest.raises(ValueError, match="outside"):
        cs.derive(ChainSteps.stage(stg, [0, 1, 2], [3] * 3, [1] * 3, [0] * 3, [REAL] * 3).t, 1)
    with pytest.raises(ValueError, match="outside"):
        cs.derive(ChainSteps.stage(stg, [0], [3], [1], [0], [REAL]).t, 3)
