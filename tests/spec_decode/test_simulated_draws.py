"""Simulated acceptance's counter-based draws (spec_decode/simulated.py): a request's acceptance
depends on its prompt, its verify step and the draft's depth alone, so two runs of one
configuration see the same acceptance whatever the batching."""
from __future__ import annotations

import numpy as np
import pytest

from adaspec import LLM, SamplingParams
from adaspec.spec_decode import simulated
from tests.helpers import prompts_of_lengths


class _Req:
    def __init__(self, prompt):
        self.prompt_token_ids, self.sim_key, self.sim_steps = prompt, None, 0


def test_uniforms_are_uniform_independent_and_deterministic():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, 4000, dtype=np.uint64)
    steps = np.arange(4000, dtype=np.uint64) % 97
    u = simulated.uniforms(keys, steps, 4)
    assert u.shape == (4000, 4) and (u >= 0).all() and (u < 1).all()
    assert np.array_equal(u, simulated.uniforms(keys, steps, 4))      # a function of its arguments
    assert np.array_equal(u[:, :2], simulated.uniforms(keys, steps, 2))   # depth d does not move with the count
    # 16,000 draws: means within ~5 sigma of 1/2, depth pairs and consecutive steps uncorrelated
    assert abs(u.mean() - 0.5) < 0.012
    acc = u < 0.8
    assert abs(acc.mean() - 0.8) < 0.016
    assert abs((acc[:, 0] & acc[:, 1]).mean() - 0.64) < 0.04
    nxt = simulated.uniforms(keys, steps + np.uint64(1), 4)
    assert abs(np.corrcoef(u.ravel(), nxt.ravel())[0, 1]) < 0.04
    one_key = simulated.uniforms(np.full(4000, keys[0]), np.arange(4000, dtype=np.uint64), 1)
    assert abs((one_key < 0.3).mean() - 0.3) < 0.04                   # over one request's steps


def test_draws_count_steps_per_request_and_pad():
    a, b = _Req([5, 6, 7]), _Req([5, 6, 8])
    first = simulated.simulated_draws([a, b], 2, 4, 0.5, seed=3)
    assert first.shape == (4, 3) and not first[2:].any()              # padding rows accept nothing
    assert (a.sim_steps, b.sim_steps) == (1, 1) and a.sim_key != b.sim_key
    alone = _Req([5, 6, 8])
    assert np.array_equal(simulated.simulated_draws([alone], 0, 4, 0.5, seed=3)[0], first[1])
    assert a.sim_key == simulated.request_key([5, 6, 7], 3) != simulated.request_key([5, 6, 7], 4)
    assert simulated.simulated_draws([a], 0, 4, None) is None and a.sim_steps == 1
    # over a request's steps the rate holds
    r = _Req(list(range(40)))
    draws = np.concatenate([simulated.simulated_draws([r], 0, 5, 0.7) for _ in range(2000)])
    assert r.sim_steps == 2000 and abs(draws.mean() - 0.7) < 0.03


@pytest.mark.parametrize("kw", [dict(num_steps=3, topk=1), dict(num_steps=2, topk=3, num_draft_tokens=7)],
                         ids=["chain3", "tree"])
def test_a_requests_acceptance_does_not_depend_on_its_batch(agree_dir, trained_head, kw):
    """Four prompts in one batch, then each alone on a fresh engine: the same tokens and the same
    acceptance per request (with one stream of draws, the batch moved every request's draws)."""
    prompts = prompts_of_lengths([9, 23, 14, 31], seed=11)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def llm():
        return LLM(agree_dir, draft=trained_head, device="cpu", dtype="float32", speculation="always",
                   spec_simulate_accept_rate=0.6, max_num_seqs=4, block_size=4, **kw)

    together = llm().generate(prompts, sp)
    alone = [llm().generate([p], sp)[0] for p in prompts]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids
        assert t.spec == a.spec and t.spec["accepted_tokens"] > 0
