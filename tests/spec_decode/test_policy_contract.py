"""The contract every registered speculation policy keeps (spec_decode/policy.py): for any batch
size and any feedback, `decide` returns None or a shape no larger than the configured one (so
the scheduler never reserves KV for more than it was configured for), `observe` accepts any
step, and `describe` says which policy it is. A new entry in POLICIES is checked here as is."""
from __future__ import annotations

import random

import pytest

from adaspec.config import SpecConfig
from adaspec.spec_decode.policy import POLICIES, StepFeedback, make_policy

SHAPES = [dict(num_steps=3, topk=1), dict(num_steps=2, topk=4, num_draft_tokens=8)]


def config(name: str, shape: dict) -> SpecConfig:
    extra = dict(spec_disable_batch_size=8) if name == "threshold" else {}
    return SpecConfig(draft=None if name == "off" else "x", policy=name, auto_profile=False, **shape, **extra)


@pytest.mark.parametrize("shape", SHAPES, ids=["chain3", "tree"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_contract(name, shape):
    cfg = config(name, shape)
    pol = make_policy(cfg)
    assert type(pol) is POLICIES[name] and pol.describe()["policy"] == name
    full = pol.configured
    rng = random.Random(7)
    seen = set()
    for step in range(400):
        b = rng.choice([1, 2, 3, 8, 9, 16, 64, 256])
        shape_ = pol.decide(b)
        if shape_ is not None:
            assert shape_.topk == full.topk
            assert shape_.num_steps <= full.num_steps and shape_.num_draft_tokens <= full.num_draft_tokens
            assert shape_.spec_slots <= full.spec_slots
        seen.add(None if shape_ is None else shape_.num_steps)
        depth = shape_.num_steps if shape_ is not None else 0
        drafted = tuple(b for _ in range(depth))
        accepted = tuple(rng.randint(0, b) for _ in range(depth))
        pol.observe(StepFeedback(batch_size=b, num_tokens=b * (1 + (shape_.num_nodes if shape_ else 0)),
                                 draft_len=shape_.num_nodes if shape_ else 0, step_time=1e-3 * (1 + depth) * b ** 0.5,
                                 accepted_per_position=accepted, drafted_per_position=drafted))
    if name == "off":
        assert seen == {None}
    if name == "always":
        assert seen == {full.num_steps}
    if name == "threshold":   # batches on both sides of the limit: both answers occur
        assert None in seen and full.num_steps in seen
