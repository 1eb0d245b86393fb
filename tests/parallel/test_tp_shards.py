"""Tensor-parallel sharding (adaspec/parallel): the cut of each dimension, and every supported
architecture's rank-0 + rank-1 shards (two gloo processes) computing the logits of the whole
model; a start-up phase failing on one rank is reported on every rank, naming it."""
from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import replace

import pytest
import torch
from moe_models import make_moe_model

from adaspec.models.registry import parse_model_spec
from adaspec.parallel import Shard
from adaspec.testing import make_tiny_model

PROMPT = [3, 17, 5, 200, 41, 9, 77, 12, 150, 8, 64, 31]


def test_cut_of_heads_vocab_and_experts(model_dirs, tmp_path):
    spec, _ = parse_model_spec(model_dirs["llama"])      # 4 heads, 2 KV heads, vocab 320, inter 128
    s0, s1 = Shard(0, 2), Shard(1, 2)
    local = s1.local_spec(spec)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 160)
    hd = spec.head_dim
    assert s1.slice_of("model.layers.0.self_attn.q_proj.weight", spec) == (0, 2 * hd, 4 * hd)
    assert s1.slice_of("model.layers.0.self_attn.v_proj.bias", spec) == (0, hd, 2 * hd)
    assert s1.slice_of("model.layers.3.self_attn.o_proj.weight", spec) == (1, 2 * hd, 4 * hd)
    assert s0.slice_of("model.layers.1.mlp.down_proj.weight", spec) == (1, 0, 64)
    assert s1.slice_of("lm_head.weight", spec) == (0, 160, 320)
    assert s1.slice_of("model.layers.0.input_layernorm.weight", spec) is None
    # Fewer KV heads than ranks: replicated, each rank holding the one its query heads read.
    assert [Shard(r, 4).heads(spec)[1] for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # A vocabulary the ranks do not divide: the last shard is short (padded at load).
    assert Shard(2, 3).vocab(320) == range(214, 320) and Shard(0, 3).vocab(320) == range(0, 107)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        Shard(0, 3).check(spec)
    moe, _ = parse_model_spec(make_moe_model(tmp_path / "q2", "qwen2_moe"))
    s = Shard(1, 2)
    assert s.local_spec(moe).moe.intermediate_size == 16 and s.local_spec(moe).moe.shared_intermediate_size == 24
    assert s.slice_of("model.layers.0.mlp.experts.3.up_proj.weight", moe) == (0, 16, 32)
    assert s.slice_of("model.layers.0.mlp.shared_expert.down_proj.weight", moe) == (1, 24, 48)
    assert s.slice_of("model.layers.0.mlp.gate.weight", moe) is None           # the router: replicated
    assert s.slice_of("model.layers.0.mlp.shared_expert_gate.weight", moe) is None
    # Expert parallelism: whole experts, a contiguous run per rank (8 experts over 3 ranks: 3, 3, 2);
    # the shared expert is still cut.
    ep = [Shard(r, 3, expert_parallel=True) for r in range(3)]
    assert [e.experts(8) for e in ep] == [range(0, 3), range(3, 6), range(6, 8)]
    local = Shard(1, 2, expert_parallel=True).local_spec(moe).moe
    assert local.local_experts == (4, 4) and local.intermediate_size == 32 and local.shared_intermediate_size == 24
    assert Shard(1, 2, expert_parallel=True).slice_of("model.layers.0.mlp.experts.5.up_proj.weight", moe) is None
    assert Shard(1, 2, expert_parallel=True).slice_of("model.layers.0.mlp.shared_expert.up_proj.weight",
                                                      moe) == (0, 24, 48)
    names = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.4.down_proj.weight_scale",
             "model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.gate.weight"]
    assert [Shard(1, 2, expert_parallel=True).holds(n, moe) for n in names] == [False, True, True, True]
    assert all(Shard(1, 2).holds(n, moe) for n in names)   # cut experts: every rank reads a slice of each
    with pytest.raises(ValueError, match="at least 16 experts"):
        Shard(0, 16, expert_parallel=True).check(replace(moe, num_heads=16, num_kv_heads=16,
                                                         intermediate_size=96 * 16))


def test_expert_parallel_rank_reads_only_its_experts(tmp_path, monkeypatch):
    """Under expert parallelism another rank's experts are never read: no tensor of them comes
    off the disk, so none is reported unread either."""
    from adaspec.models import loader

    d = make_moe_model(tmp_path / "m", "qwen3_moe")   # 8 experts: rank 1 holds 4..7
    read, warned = [], []
    real = loader.iter_tensors

    def spy(*a, **kw):
        for name, t in real(*a, **kw):
            read.append(name)
            yield name, t
    monkeypatch.setattr(loader, "iter_tensors", spy)
    monkeypatch.setattr(loader.logger, "warning", lambda *a: warned.append(a))
    model, _, _ = loader.load_model(d, torch.device("cpu"), "float32", shard=Shard(1, 2, expert_parallel=True))
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7} and not warned
    assert model.layers[0].mlp.experts.w13.shape[0] == 4


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every row of one prefill through the paged cache (torch attention)."""
    from adaspec.device.staging import Staging, stage_forward
    from adaspec.layers.attention import ForwardContext, forward_context, get_backend

    spec, T, bs = model.spec, len(ids), 16
    backend = get_backend("torch")
    stg = Staging(1 << 16, torch.device("cpu"))
    stg.begin()
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    meta, ids_d, pos_d = stage_forward(stg, backend, table, bs, spec.num_heads // spec.num_kv_heads, q_lens=[T],
                                       ctx_len=[T], kv_start=[0], req_row=[0], positions=range(T),
                                       cache_index=range(T), slots=range(T), input_ids=ids)
    stg.commit()
    kv = torch.zeros(spec.num_layers, 2, 4 * bs, spec.num_kv_heads, spec.head_dim)
    with torch.inference_mode(), forward_context(ForwardContext(meta, backend, [(k[0], k[1]) for k in kv])):
        hidden, _ = model(ids_d, pos_d)
        return model.lm_head(hidden).float()


def _rank(rank: int, dirs: list[str], init: str, out=None) -> list[torch.Tensor]:
    """This rank's part of each model (full logits, after the gather), then a failing phase."""
    from adaspec.engine.step_program import phase
    from adaspec.models.loader import load_model
    from adaspec.parallel import TPGroup
    from adaspec.parallel.group import TPStartupError
    from adaspec.parallel.layers import parallelize

    torch.set_num_threads(1)
    tp = TPGroup.init(rank, 2, torch.device("cpu"), init)
    try:
        logits = []
        for d, ep in dirs:
            shard = Shard(rank, 2, expert_parallel=ep)
            model, spec, _ = load_model(d, torch.device("cpu"), "float32", shard=shard)
            model.fuse()
            logits.append(_prefill_logits(parallelize(model, spec, shard, tp), PROMPT))

        def fail_on_rank_1():
            if rank == 1:
                raise MemoryError("no room for the KV cache")
        try:
            phase(tp, fail_on_rank_1)
            failure = None
        except TPStartupError as e:
            failure = str(e)
        if out is not None:
            out.put(failure)
        return logits, failure
    finally:
        tp.close()


def test_every_architecture_two_shards_equal_whole(model_dirs, tmp_path):
    from adaspec.models.loader import load_model

    moe = [str(make_moe_model(tmp_path / n, n)) for n in ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")]
    dirs = [(d, False) for d in list(model_dirs.values()) + moe]
    dirs += [(d, True) for d in moe]   # expert parallelism: whole experts per rank
    dirs.append((str(make_tiny_model(tmp_path / "kv1", "llama", num_kv_heads=1)), False))   # KV heads replicated
    dirs.append((str(make_tiny_model(tmp_path / "phi3", "phi3")), False))   # fused qkv / gate_up, split before the cut
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_rank, args=(1, dirs, init, q), daemon=True)
    p.start()
    try:
        sharded, failure = _rank(0, dirs, init)
        failure_1 = q.get(timeout=60)
    finally:
        p.join(timeout=30)
    assert p.exitcode == 0
    for (d, ep), got in zip(dirs, sharded):
        model, _, _ = load_model(d, torch.device("cpu"), "float32")
        model.fuse()
        want = _prefill_logits(model, PROMPT)
        assert got.shape == want.shape, d
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{d} ep={ep}: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (d, ep)
    # The phase failed on rank 1 only; both ranks raise, naming it.
    assert failure == failure_1 and "rank 1: MemoryError: no room for the KV cache" in failure
