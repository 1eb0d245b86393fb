"""What `Engine.stats` says about the steps themselves: how each launched part ran
(`launches`: CUDA graph or eager) and where the host's time per step went (`host_ms_per_step`)."""
from __future__ import annotations

from adaspec import LLM, SamplingParams
from helpers import prompts_of_lengths


def test_launches_and_host_times_count_every_step(agree_dir, trained_head):
    llm = LLM(agree_dir, draft=trained_head, speculation="always", num_steps=2, topk=1, device="cpu",
              dtype="float32")
    prompts = prompts_of_lengths([6, 9], seed=71)
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    st = llm.stats()
    n, lc = st["num_steps"], st["launches"]
    # On the CPU nothing is a graph: every step's target forward ran eagerly, once.
    assert lc["target_eager"] == n and not any(k.endswith("_graph") for k in lc)
    assert lc["post_eager"] == n                       # every step here verified or sampled something
    assert 0 < lc["chain_eager"] <= st["spec_steps"]   # chains drafted on speculative steps only
    host = st["host_ms_per_step"]
    assert set(host) == {"schedule", "launch", "collect", "postprocess", "observe", "decide"}
    assert all(v > 0 for v in host.values()), host
    assert host["decide"] <= host["schedule"]          # the decision is part of scheduling
    assert st["pdl"] is False                          # no programmatic dependent launch off a GPU


def test_step_marks_are_reused_in_turn():
    """device.marks.StepMarks: wall-clock marks on the CPU; on CUDA a ring of events recorded
    on the steps' stream, each valid for `ring` marks (the engine reads a step's two marks
    within two steps)."""
    import torch

    from adaspec.device.marks import StepMarks

    cpu = StepMarks(torch.device("cpu"))
    a, b = cpu.mark(), cpu.mark()
    assert isinstance(a, float) and b >= a
    if torch.cuda.is_available():
        m = StepMarks(torch.device("cuda"), ring=4)
        evs = [m.mark() for _ in range(5)]
        assert evs[4] is evs[0] and len({id(e) for e in evs[:4]}) == 4
        evs[3].synchronize()
        assert evs[2].elapsed_time(evs[3]) >= 0
