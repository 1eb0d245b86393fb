"""EAGLE-3 aux features on the target side (issue 26, items 1-2): the inputs of the captured
layers concatenated in LAYER order, each layer once, whatever order or repetition the head's
config lists them in (vLLM's, SGLang's and EAGLE's capture loops append as the layers run)."""
from __future__ import annotations

import pytest
import torch

from adaspec.layers.attention import AttnMeta, ForwardContext, forward_context, get_backend, launch_plan
from adaspec.models.loader import load_model


def _layer_inputs(model_dir, ids):
    """Independent reference: transformers' hidden_states[i] is the input of layer i (i < L)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def _prefill_meta(T: int) -> AttnMeta:
    """One request, T prompt rows, all in one KV block of T slots."""
    i32 = torch.int32
    prog_req, prog_q0 = launch_plan([T], 1)
    return AttnMeta(positions=torch.arange(T), cache_index=torch.arange(T, dtype=i32), slot_mapping=torch.arange(T),
                    query_start=torch.tensor([0, T], dtype=i32), ctx_len=torch.tensor([T], dtype=i32),
                    kv_start=torch.zeros(1, dtype=i32), req_row=torch.zeros(1, dtype=i32),
                    mask_start=torch.tensor([T], dtype=i32), mask_offset=torch.zeros(1, dtype=i32),
                    block_table=torch.zeros(1, 1, dtype=i32), mask=torch.zeros(1, dtype=torch.uint8),
                    prog_req=torch.from_numpy(prog_req), prog_q0=torch.from_numpy(prog_q0), block_q=1,
                    block_size=T, max_ctx_len=T, max_q_len=T)


def _aux(model_dir, ids, capture):
    model, spec, _ = load_model(model_dir, torch.device("cpu"), "float32")
    model.fuse()
    model.capture = capture
    T = len(ids)
    kv = [(torch.zeros(T, spec.num_kv_heads, spec.head_dim), torch.zeros(T, spec.num_kv_heads, spec.head_dim))
          for _ in range(spec.num_layers)]
    meta = _prefill_meta(T)
    with torch.no_grad(), forward_context(ForwardContext(meta, get_backend("torch"), kv)):
        _, aux = model(torch.tensor(ids), torch.arange(T))
    return model, aux


@pytest.mark.parametrize("capture,layers", [((3, 1), (1, 3)), ((2, 2, 1), (1, 2)), ((0, 3, 2), (0, 2, 3))])
def test_aux_features_are_in_layer_order_each_once(llama_dir, capture, layers):
    ids = [5, 9, 33, 2, 17, 250]
    model, aux = _aux(llama_dir, ids, capture)
    assert model.capture == layers
    hs = _layer_inputs(llama_dir, ids)
    want = torch.cat([hs[i][0] for i in layers], dim=-1)
    assert aux.shape == want.shape
    torch.testing.assert_close(aux, want, rtol=1e-5, atol=1e-5)
