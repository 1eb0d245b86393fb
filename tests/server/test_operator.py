"""The operator's side (issue 25): values checked at start-up with the flag named, the context
cut by a small KV cache said out loud, the periodic stats line, and vLLM's metric names."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaspec.server import cli
from adaspec.server.metrics import ServerMetrics
from adaspec.server.stats_log import log_stats_forever, stats_line
from adaspec.testing import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("operator") / "m", "llama", tokenizer=True))


@pytest.fixture
def no_start(monkeypatch):
    """serve_main must give up before binding a port or loading anything."""
    def refuse(*a, **k):
        raise AssertionError("got past validation")
    monkeypatch.setattr(cli, "_bind", refuse)
    monkeypatch.setattr(cli, "_load_engine", refuse)


@pytest.mark.parametrize("flags,named", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--block-size", "7"], "--block-size"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["--tokenizer", "/no/such/tokenizer"], "--tokenizer"),
    (["--draft", "/no/such/head"], "--draft"),
    (["--speculation", "threshold", "--draft", "DRAFT"], "--spec-disable-batch-size"),
    (["--max-prompts-per-request", "0"], "--max-prompts-per-request"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
    (["--device", "tpu"], "--device"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--speculative-config", '{"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 0}'],
     "--num-steps"),
    (["--speculative-config", '{"model": "DRAFT", "num_speculative_tokens": 4}', "--num-steps", "2"],
     "--speculative-config"),
    (["MODEL2"], "given twice"),
])
def test_bad_values_are_one_line_errors_naming_the_flag(model_dir, no_start, caplog, flags, named):
    flags = [f.replace("DRAFT", model_dir) if f != "MODEL2" else model_dir + "-other" for f in flags]
    assert cli.serve_main(["--model", model_dir, *flags]) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and named in errors[0].getMessage(), caplog.text
    assert "\n" not in errors[0].getMessage()


def test_a_step_budget_below_the_batch_is_a_warning(model_dir, no_start, caplog):
    with pytest.raises(AssertionError, match="got past validation"):      # valid: it goes on to bind
        cli.serve_main(["--model", model_dir, "--max-num-batched-tokens", "1"])
    assert "--max-num-batched-tokens 1 is below --max-num-seqs 256" in caplog.text


def test_hub_id_gets_a_hint(no_start, caplog):
    assert cli.serve_main(["meta-llama/Llama-3.1-8B-Instruct"]) == 2     # vLLM's positional MODEL
    assert "local directories only" in caplog.text
    assert "hf download meta-llama/Llama-3.1-8B-Instruct --local-dir DIR" in caplog.text
    assert "huggingface-cli download" in caplog.text


def test_vllm_spellings_and_version(model_dir, capsys):
    """vLLM's flags map onto the same options as adaspec's older spellings; every flag has help."""
    from adaspec.cli import main
    from adaspec.config import EngineConfig, engine_kwargs_from_cli

    def cfg(*words):
        a = cli.build_serve_parser().parse_args(list(words))
        return EngineConfig.create(a.model_tag or a.model, **engine_kwargs_from_cli(a))

    new = cfg(model_dir, "--dtype", "half", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "8",
              "--kv-cache-memory-bytes", "4096", "--chat-template", "{{ messages[0].content }}",
              "--speculative-config", f'{{"method": "eagle3", "model": "{model_dir}", "num_speculative_tokens": 5}}')
    old = cfg("--model", model_dir, "--dtype", "float16", "--no-prefix-caching", "--num-kv-blocks", "8",
              "--kv-cache-memory", "4096", "--chat-template", "{{ messages[0].content }}", "--draft", model_dir,
              "--num-steps", "5")
    assert new == old and new.dtype == "float16" and new.spec.num_steps == 5 and new.spec.policy == "always"
    assert not new.cache.enable_prefix_caching and new.cache.num_blocks == 8
    assert cfg(model_dir, "--dtype", "float").dtype == "float32"
    undocumented = [a.option_strings for a in cli.build_serve_parser()._actions if not a.help]
    assert undocumented == []
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"adaspec {__import__('adaspec').__version__}"


def test_chat_template_flag_replaces_the_tokenizers(model_dir, tmp_path):
    from adaspec.tokenization import load_tokenizer
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    for given in (str(path), path.read_text()):
        tok = load_tokenizer(model_dir, given)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_a_context_cut_by_the_kv_cache_is_a_warning(model_dir, caplog):
    args = SimpleNamespace(model=model_dir, max_model_len=None)
    cli._warn_if_context_cut(args, SimpleNamespace(max_model_len=15))       # 1 block of 16
    assert "context is cut to 15 tokens" in caplog.text and "--num-kv-blocks" in caplog.text
    caplog.clear()
    cli._warn_if_context_cut(args, SimpleNamespace(max_model_len=512))      # the model's own 512
    assert not caplog.text


BEFORE = {"prompt_tokens": 100, "generation_tokens": 50, "prefix_cache_hit_tokens": 10, "verify_steps": 10,
          "draft_tokens": 30, "accepted_tokens": 15, "spec_steps": 10, "nonspec_steps": 0}
AFTER = {"prompt_tokens": 300, "generation_tokens": 250, "prefix_cache_hit_tokens": 60, "verify_steps": 60,
         "draft_tokens": 180, "accepted_tokens": 90, "spec_steps": 45, "nonspec_steps": 5, "num_running": 3,
         "num_waiting": 1, "num_free_blocks": 75, "num_total_blocks": 100, "policy": "auto",
         "last_draft_len": 3, "policy_state": {"goodput": {0: 800.0, 3: 1190.5}}}


def test_stats_line_is_over_the_interval():
    line = stats_line(BEFORE, AFTER, 10.0)
    assert line.startswith("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 20.0 tokens/s")
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%" in line
    # 75 accepted over 50 verify steps: 1 + 1.5; 75 of 150 draft tokens; 35 of 40 steps speculated.
    assert ("speculation auto: draft length 3 (last step), acceptance length 2.50, 50.0% of draft tokens "
            "accepted, 88% of steps speculated, goodput by draft length {0: 800.0, 3: 1190.5}") in line
    assert stats_line(AFTER, {**AFTER, "num_running": 0, "num_waiting": 0}, 10.0) is None   # idle: silent
    assert "speculation" not in stats_line(BEFORE, {**AFTER, "policy": "off"}, 10.0)


def test_stats_are_logged_periodically(caplog):
    snapshots = iter([BEFORE, AFTER] + [AFTER] * 1000)

    async def run():
        task = asyncio.create_task(log_stats_forever(lambda: next(snapshots), 0.01))
        while "Avg prompt throughput" not in caplog.text:
            await asyncio.sleep(0.01)
        task.cancel()
    with caplog.at_level(logging.INFO, logger="adaspec.server"):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert caplog.text.count("Avg prompt throughput") == 1     # the idle intervals after it log nothing


def test_vllm_metric_names():
    stats = {**AFTER, "accepted_per_position": [50, 30, 10]}
    m = ServerMetrics(lambda: stats, lambda: 4, model_name="tiny")
    stream = SimpleNamespace(arrival=0.0, first_token_time=None, last_token_time=None)
    m.on_output(stream, SimpleNamespace(new_token_ids=[5], finished=False, finish_reason=None), 0.25)
    stream.first_token_time = stream.last_token_time = 0.25
    m.on_output(stream, SimpleNamespace(new_token_ids=[6, 7], finished=True, finish_reason="length",
                                        prompt_token_ids=[1] * 7, token_ids=[5, 6, 7], queue_time=0.05), 0.45)
    got = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    tiny = (("model_name", "tiny"),)
    assert got[("vllm:num_requests_running", tiny)] == 3 and got[("vllm:num_requests_waiting", tiny)] == 1
    assert got[("vllm:kv_cache_usage_perc", tiny)] == 0.25 == got[("vllm:gpu_cache_usage_perc", tiny)]
    assert got[("vllm:prompt_tokens_total", tiny)] == 300 and got[("vllm:generation_tokens_total", tiny)] == 250
    assert got[("vllm:prefix_cache_queries_total", tiny)] == 300 and got[("vllm:prefix_cache_hits_total", tiny)] == 60
    assert got[("vllm:spec_decode_num_drafts_total", tiny)] == 60
    assert got[("vllm:spec_decode_num_draft_tokens_total", tiny)] == 180
    assert got[("vllm:spec_decode_num_accepted_tokens_total", tiny)] == 90
    assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "tiny"), ("position", "1")))] == 30
    assert got[("vllm:time_to_first_token_seconds_count", tiny)] == 1
    assert got[("vllm:time_to_first_token_seconds_sum", tiny)] == 0.25
    assert got[("vllm:inter_token_latency_seconds_count", tiny)] == 2
    assert got[("vllm:e2e_request_latency_seconds_count", tiny)] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] == 1
    assert got[("adaspec_time_to_first_token_seconds_count", ())] == 1    # adaspec's own stay
    # The request's phases: queued 0.05 s, first token at 0.25 s, last at 0.45 s.
    for phase, seconds in (("queue", 0.05), ("prefill", 0.20), ("decode", 0.20), ("inference", 0.40)):
        assert got[(f"vllm:request_{phase}_time_seconds_sum", tiny)] == pytest.approx(seconds)
        assert got[(f"adaspec_request_{phase}_time_seconds_count", ())] == 1
    assert got[("vllm:request_prompt_tokens_sum", tiny)] == 7 and got[("vllm:request_generation_tokens_sum", tiny)] == 3
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "10.0"), ("model_name", "tiny")))] == 1
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "5.0"), ("model_name", "tiny")))] == 0


def test_server_info_shows_the_policys_cost_table():
    from adaspec.config import EngineConfig
    from adaspec.server.info import server_info
    from adaspec.spec_decode.policy import AutoPolicy, StepFeedback

    cfg = EngineConfig.create("m", draft="d", speculation="auto", num_steps=2, spec_auto_profile=False)
    pol = AutoPolicy(cfg.spec)
    pol.observe(StepFeedback(batch_size=4, num_tokens=12, draft_len=2, step_time=0.006,
                             accepted_per_position=(3, 2), drafted_per_position=(4, 4)))
    pol.decide(4)
    aengine = SimpleNamespace(config=cfg, stats={"policy_state": pol.describe(), "num_total_blocks": 8},
                              draft_format=None, max_model_len=64, sampling_defaults={}, num_inflight=0)
    settings = SimpleNamespace(served_model_name="m", max_queue_len=8, max_prompts_per_request=4)
    info = server_info(SimpleNamespace(aengine=aengine, settings=settings))
    assert info["policy"]["name"] == "auto" and info["policy"]["step_ms"] == {"2": {4: 6.0}}
    assert info["policy"]["tau"][0] == 1.0 and set(info["policy"]["goodput"]) == {2}


def test_the_start_up_line_names_the_largest_draft():
    from adaspec.config import SpecConfig
    from adaspec.server.cli import _speculation_text
    assert _speculation_text(SpecConfig(draft="h", policy="auto", num_steps=8)) == \
        "auto, chains of up to 8 drafts"
    assert _speculation_text(SpecConfig(draft="h", policy="always", num_steps=2, topk=4, num_draft_tokens=16)) == \
        "always, trees of 2 steps x 4 (16 tokens)"
    assert _speculation_text(SpecConfig(draft="h", policy="off")) == "off"
