"""vLLM's request fields over HTTP, on the session's speculative server (speculation always):
stop_reason and include_stop_str_in_output, prompt_logprobs (equal to transformers'),
return_tokens_as_token_ids, truncate_prompt_tokens, bad_words, allowed_token_ids,
skip_special_tokens, add_special_tokens, request_id, chat echo, cache_salt; the vLLM fields
adaspec does not implement are 400s naming them, and unknown fields are logged once."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import MODEL_NAME

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def url(spec_server):
    return spec_server.url


@pytest.fixture(scope="module")
def tokenizer(spec_server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(spec_server.proc.args[spec_server.proc.args.index("--model") + 1])


def _post(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


def test_stop_reason_and_include_stop_str(url, tokenizer):
    full = _post(url, _greedy(return_token_ids=True))["choices"][0]
    assert full["finish_reason"] == "length" and full["stop_reason"] is None
    ids = full["token_ids"]
    stop = tokenizer.decode(ids[3:5])
    assert stop and stop in full["text"]
    at = full["text"].index(stop)
    for include in (False, True):
        c = _post(url, _greedy(stop=[stop], include_stop_str_in_output=include))["choices"][0]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
        assert c["text"] == full["text"][:at + (len(stop) if include else 0)]
        events = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, **_greedy(stop=[stop], stream=True,
                            include_stop_str_in_output=include)}, timeout=120).text
        chunks = [line[6:] for line in events.splitlines() if line.startswith("data: {")]
        import json
        texts = [json.loads(x)["choices"][0] for x in chunks]
        assert "".join(t["text"] for t in texts) == c["text"] and texts[-1]["stop_reason"] == stop
    c = _post(url, _greedy(stop_token_ids=[ids[4]]))["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == ids[4]


def test_prompt_logprobs_equal_transformers(url, tokenizer, spec_server):
    import torch
    from transformers import AutoModelForCausalLM

    body = _post(url, _greedy(max_tokens=2, prompt_logprobs=3, return_token_ids=True))
    c = body["choices"][0]
    prompt = c["prompt_token_ids"]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    model_dir = spec_server.proc.args[spec_server.proc.args.index("--model") + 1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    for j in range(1, len(prompt)):
        entry = plp[j]
        assert entry[str(prompt[j])]["logprob"] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-3)
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2, 3]
        assert [t for _, t in ranked] == ref[j - 1].topk(3).indices.tolist()
        assert all(v["decoded_token"] == tokenizer.decode([int(t)]) for t, v in entry.items())
    chat = _post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1},
                 "/v1/chat/completions")
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_tokens_as_ids_truncation_and_special_tokens(url, tokenizer):
    c = _post(url, _greedy(max_tokens=3, logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True))
    ch = c["choices"][0]
    assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
    long_prompt = " ".join(["fox"] * 600)
    ids = tokenizer.encode(long_prompt)
    assert len(ids) > 512
    cut = _post(url, {"prompt": long_prompt, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 50,
                      "return_token_ids": True})["choices"][0]
    assert cut["prompt_token_ids"] == ids[-50:]
    assert cut["token_ids"] == _post(url, {"prompt": ids[-50:], "max_tokens": 4, "temperature": 0,
                                           "return_token_ids": True})["choices"][0]["token_ids"]
    eos = tokenizer.eos_token_id
    kept = _post(url, _greedy(max_tokens=3, logit_bias={str(eos): 100}, skip_special_tokens=False))["choices"][0]
    assert kept["text"] == tokenizer.eos_token * 3
    assert _post(url, _greedy(max_tokens=3, logit_bias={str(eos): 100}))["choices"][0]["text"] == ""
    with_bos = _post(url, _greedy(max_tokens=1))["usage"]["prompt_tokens"]
    without = _post(url, _greedy(max_tokens=1, add_special_tokens=False))["usage"]["prompt_tokens"]
    assert with_bos - without == len(tokenizer.encode(PROMPT)) - len(tokenizer.encode(PROMPT, add_special_tokens=False))


def test_bad_words_and_allowed_token_ids(url, tokenizer):
    full = _post(url, _greedy(return_token_ids=True))["choices"][0]
    word = tokenizer.decode(full["token_ids"][2:4]).strip()
    banned = _post(url, _greedy(bad_words=[word], return_token_ids=True))["choices"][0]
    from adaspec.tokenization import bad_word_ids
    for seq in bad_word_ids(tokenizer, [word]):
        ids = banned["token_ids"]
        assert not any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids)))
    assert banned["token_ids"] != full["token_ids"]
    allowed = sorted(set(full["token_ids"][1:]))[:3] + [5, 6]
    only = _post(url, _greedy(allowed_token_ids=allowed, return_token_ids=True))["choices"][0]
    assert set(only["token_ids"]) <= set(allowed)


def test_request_id_chat_echo_and_cache_salt(url):
    a = _post(url, _greedy(max_tokens=1, request_id="my-id-1"))
    b = _post(url, _greedy(max_tokens=1, request_id="my-id-1"))   # reused: still served
    assert a["id"] == b["id"] == "cmpl-my-id-1"
    r = httpx.post(url + "/v1/completions", json=_greedy(max_tokens=1), headers={"X-Request-Id": "hdr"}, timeout=60)
    assert r.json()["id"] == "cmpl-hdr"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "continue_final_message": True,
            "add_generation_prompt": False, "ignore_eos": True}
    plain = _post(url, body, "/v1/chat/completions")["choices"][0]["message"]["content"]
    echoed = _post(url, {**body, "echo": True}, "/v1/chat/completions")["choices"][0]["message"]["content"]
    assert echoed == "Sure, " + plain
    def hits() -> int:
        return httpx.get(url + "/server_info").json()["stats"]["prefix_cache_hit_tokens"]

    long = {"prompt": "salted fox " * 40, "max_tokens": 1, "temperature": 0}
    _post(url, {**long, "cache_salt": "tenant-a"})
    before = hits()
    _post(url, {**long, "cache_salt": "tenant-b"})      # another tenant: no hit
    assert hits() == before
    _post(url, {**long, "cache_salt": "tenant-a"})      # the same tenant: a hit
    assert hits() > before


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("length_penalty", 0.5), ("priority", 3),
                                         ("bad_words", [""]), ("allowed_token_ids", [10 ** 7]),
                                         ("truncate_prompt_tokens", 0), ("prompt_logprobs", 99)])
def test_unimplemented_or_bad_vllm_fields_are_400(url, field, value):
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_chat_only_refusals(url):
    for field, value in (("chat_template", "{{ x }}"), ("add_special_tokens", True), ("documents", [{"a": 1}]),
                         ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}),
                         ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {})):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_openai_sdk_reads_stop_reason(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    c = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"stop_token_ids": [0, 1, 2]})
    assert "stop_reason" in c.choices[0].model_extra


def test_vllm_serve_flags(tok_model_dir):
    """A vLLM command line's flags: accepted (their behaviour is adaspec's already), acted on
    (prompt token details, token ids as logprob tokens, the answer's role), or refused by name."""
    from server_helpers import ServerProcess

    srv = ServerProcess(["--model", tok_model_dir, "--num-kv-blocks", "128", "--max-model-len", "256",
                         "--trust-remote-code", "--enable-auto-tool-choice", "--enable-chunked-prefill",
                         "--disable-log-requests", "--kv-cache-dtype", "auto", "--pipeline-parallel-size", "1",
                         "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "--response-role", "bot",
                         "--enable-expert-parallel"])
    try:
        body = {"prompt": "salted fox " * 12, "max_tokens": 2, "temperature": 0, "logprobs": 0}
        first = _post(srv.url, body)
        again = _post(srv.url, body)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert all(t.startswith("token_id:") for t in again["choices"][0]["logprobs"]["tokens"])
        words = _post(srv.url, {**body, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]["tokens"]
        assert not any(t.startswith("token_id:") for t in words)
        chat = _post(srv.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "/v1/chat/completions")
        assert chat["choices"][0]["message"]["role"] == "bot"
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
        assert info["config"]["enable_expert_parallel"] is True   # a dense model on one rank: no effect
    finally:
        code, out = srv.stop()
    assert code == 0, out


@pytest.mark.parametrize("flags,says", [(["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
                                        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
                                        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill")])
def test_unsupported_vllm_flag_values_exit_2(flags, says):
    import subprocess
    import sys

    from server_helpers import REPO
    out = subprocess.run([sys.executable, "-m", "adaspec.cli", "serve", "--model", "/nonexistent", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr


def test_ping_answers_as_health(url):
    assert httpx.get(url + "/ping").json() == httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.post(url + "/ping", json={}).status_code == 200


def test_echo_of_a_truncated_prompt_is_what_the_model_saw(url, tokenizer):
    ids = tokenizer.encode(PROMPT + " jumps over the lazy dog")
    c = _post(url, {"prompt": PROMPT + " jumps over the lazy dog", "max_tokens": 2, "temperature": 0, "echo": True,
                    "truncate_prompt_tokens": 4, "return_token_ids": True})["choices"][0]
    assert c["prompt_token_ids"] == ids[-4:]
    assert c["text"].startswith(tokenizer.decode(ids[-4:])) and not c["text"].startswith(PROMPT)


def test_a_bad_word_too_long_names_the_field(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                  "bad_words": [" ".join(["fox"] * 100)]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def test_echo_with_max_tokens_0_answers_with_the_scored_prompt(url, tokenizer):
    """OpenAI's scoring form (lm-eval style loglikelihood, served by vLLM too): the prompt and
    its logprobs, nothing generated; the same numbers as echo with a token, minus the token."""
    ids = tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    c = _post(url, body)["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:]) and len(lp["top_logprobs"][1]) >= 2
    one = _post(url, {**body, "max_tokens": 1})["choices"][0]
    assert len(one["logprobs"]["tokens"]) == len(ids) + 1
    assert one["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"]
    assert one["logprobs"]["text_offset"][:len(ids)] == lp["text_offset"]
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL_NAME, **body, "stream": True},
                      timeout=120) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json
    choices = [ch for line in chunks for ch in json.loads(line)["choices"]]
    assert "".join(ch["text"] for ch in choices) == PROMPT
    assert [t for ch in choices for t in (ch["logprobs"] or {}).get("tokens", [])] == lp["tokens"]
    without_echo = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, **body, "echo": False}, timeout=60)
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"


def test_text_parts_of_a_message_are_one_per_line(url):
    """A message's content given as text parts renders as vLLM renders it: the parts joined
    by newlines (clients such as `vllm bench serve --backend openai-chat` send parts)."""
    def ids(content):
        r = httpx.post(url + "/tokenize", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    parts = [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown fox"}]
    assert ids(parts) == ids("The quick\nbrown fox") != ids("The quickbrown fox")
