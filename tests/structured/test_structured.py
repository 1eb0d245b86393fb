"""Structured outputs under speculation: greedy output with a grammar is the same with
speculation off, chains, trees and the policies' crossings (threshold at a batch size, a draft
length of 0); every JSON generated under a JSON Schema validates; the sampled law is the
target's masked by the grammar. A random tiny model cannot write JSON: the grammar does."""
from __future__ import annotations

import json
import random
import re

import pytest

from adaspec import LLM, SamplingParams
from adaspec.structured import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"},
                         "kind": {"enum": ["a", "bb"]}}}
REQUESTS = [  # (prompt, structured output, per-request draft cap)
    ("Hello", StructuredOutput.json_schema(SCHEMA), None),
    ("The quick", StructuredOutput("regex", r"(ab|c)[0-9]{2,4}x"), None),
    ("def add", StructuredOutput.choice(["yes", "no", "maybe"]), None),
    ("café", StructuredOutput("json"), None),
    ("Speculative", None, None),                                   # no grammar, same batch
    ("Hello world", StructuredOutput.json_schema(SCHEMA), 0),      # its draft length is 0
]


def _generate(model, **kw):
    llm = LLM(model, device="cpu", dtype="float32", **kw)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured=s, max_draft_tokens=cap)
              for _, s, cap in REQUESTS]
    return llm, llm.generate([p for p, _, _ in REQUESTS], params)


def test_greedy_with_grammar_equals_speculation_off(tok_model_dir, tok_head_dir):
    _, ref = _generate(tok_model_dir)
    # Every constrained output obeys its grammar and ends (the stop token is only legal once complete).
    for (_, s, _), o in zip(REQUESTS, ref):
        if s is None:
            continue
        if s.kind == "json":   # free-form strings: a random model may wander in one to the end
            assert o.text.startswith("{") and (o.finish_reason == "length" or isinstance(json.loads(o.text), dict))
            continue
        assert o.finish_reason == "stop", (s, o.text)
        if s.kind == "json_schema":
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif s.kind == "regex":
            assert re.fullmatch(s.value, o.text), o.text
        else:
            assert o.text in ("yes", "no", "maybe")
    runs = {
        "chain": dict(speculation="always", num_steps=3),
        "tree": dict(speculation="always", num_steps=2, topk=2, num_draft_tokens=4),
        # 6 requests start above the threshold (no drafts), and cross below it as two finish
        # (at 5: drafting resumes after its catch-up with tokens left to speculate on).
        "threshold": dict(speculation="threshold", spec_disable_batch_size=5, num_steps=3),
        "auto": dict(speculation="auto", num_steps=3),
    }
    for name, kw in runs.items():
        llm, outs = _generate(tok_model_dir, draft=tok_head_dir, **kw)
        for r, o in zip(ref, outs):
            assert o.token_ids == r.token_ids, (name, o.text, r.text)
        st = llm.engine.stats()
        if name != "auto":   # the tiny model's auto policy may never speculate
            assert st["verify_steps"] > 0, name
        if name == "threshold":
            assert st["nonspec_steps"] > 0 and st["spec_steps"] > 0


def test_accepted_drafts_under_a_grammar(agree_dir, trained_head):
    """A head that agrees with its target, so drafts are accepted, under a grammar that forbids
    a third of the vocabulary: greedy output is the same with speculation off, chains and trees,
    and never holds a forbidden token (tokens are single characters of a raw vocabulary). Two
    requests add penalties, logit_bias and logprobs to the grammar: the mask composes with them
    (same output and logprobs everywhere) and the logprobs stay the raw target's (forbidden
    tokens among the alternatives)."""
    from adaspec.structured.grammar import GrammarCache

    from helpers import prompts_of_lengths

    pieces = [chr(0x4E00 + i) for i in range(320)]
    allowed = [i for i in range(320) if i % 3]
    spec = StructuredOutput("regex", "[" + "".join(pieces[i] for i in allowed) + "]*")
    prompts = prompts_of_lengths([5, 9, 14, 7], seed=3)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, structured=spec)
    mixed = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, structured=spec, repetition_penalty=1.5,
                           frequency_penalty=0.5, logit_bias={3: 100.0, 4: 5.0}, logprobs=3)
    params = [sp] * len(prompts) + [mixed] * 2
    prompts = prompts + prompts[:2]
    outs, lps = {}, {}
    for name, kw in {"off": {}, "chain": dict(draft=trained_head, speculation="always", num_steps=4),
                     "tree": dict(draft=trained_head, speculation="always", num_steps=3, topk=2,
                                  num_draft_tokens=6),
                     # grammar steps are planned ahead like any other (their mask is built once the
                     # step before is read back): the same with every step waited for
                     "chain-serial": dict(draft=trained_head, speculation="always", num_steps=4,
                                          overlap=False)}.items():
        llm = LLM(agree_dir, device="cpu", dtype="float32", **kw)
        llm.engine.grammars = GrammarCache.from_vocab(pieces, stop_token_ids=[1])
        res = llm.generate(prompts, params)
        outs[name] = [o.token_ids for o in res]
        lps[name] = [o.logprobs for o in res[-2:]]
        if name != "off":
            assert llm.stats()["accepted_tokens"] > 0, name
        assert (llm.stats()["overlapped_steps"] > 0) == (name != "chain-serial"), name
    assert outs["chain"] == outs["off"] and outs["tree"] == outs["off"] and outs["chain-serial"] == outs["off"]
    assert all(t % 3 for o in outs["off"] for t in o)
    assert outs["off"][-2:] != outs["off"][:2]   # the penalties changed the output, within the grammar
    for name in ("chain", "tree", "chain-serial"):
        for got, ref in zip(lps[name], lps["off"]):
            assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in ref], abs=1e-4)
    alts = [t for o in lps["off"] for _, top in o for t, _ in top]
    assert len(alts) == 2 * 24 * 3 and any(t % 3 == 0 for t in alts)   # raw: not masked
    free = [o.token_ids for o in LLM(agree_dir, device="cpu", dtype="float32").generate(
        prompts[:4], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]
    assert free != outs["off"][:4]   # the grammar changed the output


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A short JSON Schema whose every instance is a few tokens long (bounded strings, integer
    ranges, enums, small arrays, one level of nesting)."""
    def leaf():
        kind = rng.choice(["int", "str", "bool", "enum", "array", "null", "const"] + (["obj"] if depth == 0 else []))
        if kind == "int":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
        if kind == "str":
            return {"type": "string", "minLength": rng.randint(0, 1), "maxLength": rng.randint(1, 4)}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "x", "42", "ok"], rng.randint(1, 3))}
        if kind == "array":
            return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 0, "maxItems": rng.randint(1, 3)}
        if kind == "null":
            return {"type": "null"}
        if kind == "const":
            return {"const": rng.choice(["v1", 7, True])}
        return _random_schema(rng, depth + 1)

    names = rng.sample(["a", "b", "id", "name", "n", "flag", "v"], rng.randint(1, 3))
    return {"type": "object", "properties": {k: leaf() for k in names},
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def test_every_json_validates_against_its_schema(tok_model_dir, tok_head_dir):
    """100 random schemas in one batch, under speculation, sampled: 0 invalid, all complete."""
    rng = random.Random(0)
    schemas = [_random_schema(rng) for _ in range(100)]
    llm = LLM(tok_model_dir, draft=tok_head_dir, speculation="always", num_steps=3, device="cpu", dtype="float32")
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured=StructuredOutput.json_schema(s))
              for i, s in enumerate(schemas)]
    outs = llm.generate(["Hello"] * len(schemas), params)
    invalid = []
    for s, o in zip(schemas, outs):
        try:
            assert o.finish_reason == "stop", o.finish_reason
            jsonschema.validate(json.loads(o.text), s)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            invalid.append((s, o.text, str(e)[:200]))
    assert not invalid, invalid[:3]
    # Simulated acceptance (benchmarks) emits only tokens the grammar allows: outputs stay valid.
    sim = LLM(tok_model_dir, draft=tok_head_dir, speculation="always", num_steps=3, device="cpu", dtype="float32",
              spec_simulate_accept_rate=0.9)
    outs = sim.generate(["Hello"] * 10, params[:10])
    for s, o in zip(schemas, outs):
        assert o.finish_reason == "stop" and o.error is None, o
        jsonschema.validate(json.loads(o.text), s)
    # ... and where the grammar allows much, drafts are accepted (not one holding a "<").
    outs = sim.generate(["Hello"] * 4, SamplingParams(max_tokens=24, temperature=0.0,
                                                      structured=StructuredOutput("regex", "[^<]*")))
    assert all(o.error is None and "<" not in o.text for o in outs) and sim.stats()["accepted_tokens"] > 0
    # A schema that does not compile is a ValueError naming the problem, at admission.
    with pytest.raises(ValueError, match="json_schema"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput("json_schema", '{"type": "nonsense"}')))
    with pytest.raises(ValueError, match="min_tokens cannot be combined with a structured output"):
        SamplingParams(min_tokens=2, structured=StructuredOutput("json"))


def test_sampled_law_is_the_masked_target(tmp_path):
    """Speculative sampling (trees) with a grammar: the first two tokens follow the target's
    law restricted to what the grammar allows at each (false-alarm rate 1e-3)."""
    import torch

    from adaspec.structured.grammar import GrammarCache
    from adaspec.testing import make_eagle3_head, make_tiny_model

    from helpers import chi2_pvalue, two_token_counts, two_token_expected

    d = make_tiny_model(tmp_path / "v8", "llama", vocab_size=8, init_std=0.1, eos_token_id=None)
    head = make_eagle3_head(tmp_path / "h8", d)
    cache = GrammarCache.from_vocab(list("abcdefgh"), stop_token_ids=[7])
    grammar = (cache, StructuredOutput("regex", "[a-d][b-g][c-e]"), [0, 1, 2, 3], [1, 2, 3, 4, 5, 6])
    n = 2000
    counts, llm, outs = two_token_counts(d, head, n, sampling={"structured": grammar[1]}, grammars=cache)

    def masked(lg, _prompt, out):   # the target's logits, masked to the grammar's tokens there
        keep = torch.zeros(8, dtype=torch.bool)
        keep[grammar[2] if not out else grammar[3]] = True
        return lg.masked_fill(~keep, float("-inf"))

    pvalue = chi2_pvalue(counts, two_token_expected(d, process=masked), n)
    # The third token comes from a draft node's mask whenever the second draft was accepted.
    assert all(o.token_ids[0] in grammar[2] and o.token_ids[1] in grammar[3] and o.token_ids[2] in (2, 3, 4)
               and o.error is None for o in outs)
    st = llm.stats()
    assert st["verify_steps"] >= n and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert pvalue > 1e-3
