"""The `logprobs` objects of OpenAI responses, from the engine's per-token entries
(`RequestOutput.logprobs`: (logprob, ((token id, logprob),) * k) per token, the target's raw
log-probabilities; see `adaspec.sampling`).

    /v1/completions        {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
                           (with `echo`, the prompt's tokens first; the first has no logprob)
    /v1/chat/completions   {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

A token is shown as what it decodes to alone (vLLM's default); as "token_id:<id>" without a
tokenizer or when the request sets vLLM's `return_tokens_as_token_ids`.

vLLM's `prompt_logprobs` field (`prompt_logprobs_json`): per prompt token, None for the first,
else {"<token id>": {"logprob", "rank", "decoded_token"}} for the token and the k likeliest;
`rank` is 1 for the likeliest, and null for a prompt token outside the k (adaspec does not
rank the whole vocabulary).
"""
from __future__ import annotations

# JSON has no -Infinity: a logprob that underflowed is reported as this (as vLLM does).
FLOOR = -9999.0


class TokenText:
    """Token id -> its text, cached (every alternative of every token is looked up)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = None if as_ids else tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            if len(self.cache) < 1 << 16:
                self.cache[tid] = s
        return s


def _lp(x: float) -> float:
    return max(float(x), FLOOR)


def completion_logprobs(text: TokenText, ids: list[int], entries: list, offset: int,
                        prompt: tuple[list[int], list] | None = None) -> tuple[dict, int]:
    """(the completions `logprobs` object of `ids` with their `entries`, the text offset after
    them). `offset`: where the first token's text starts; `prompt` (ids, prompt_logprobs)
    puts the echoed prompt's tokens first."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pairs = list(zip(ids, entries))
    if prompt is not None:
        pairs = list(zip(*prompt)) + pairs
    for tid, e in pairs:
        s = text(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if e is None:        # the prompt's first token: nothing predicts it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(e[0]))
        top: dict[str, float] = {}
        for t, v in e[1]:   # most likely first: two ids with one text keep the likelier
            top.setdefault(text(t), _lp(v))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(text: TokenText, ids: list[int], entries: list) -> dict:
    """The chat `logprobs` object ({"content": [...]}) of `ids` with their `entries`."""
    def item(tid: int, lp: float) -> dict:
        s = text(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(tid, e[0]), "top_logprobs": [item(t, v) for t, v in e[1]]}
                        for tid, e in zip(ids, entries)]}


def cut_alternatives(entries: list, k: int) -> list:
    """Per-token entries with at most k alternatives each (None entries kept)."""
    return [None if e is None else (e[0], e[1][:k]) for e in entries]


def prompt_logprobs_json(text: TokenText, ids: list[int], entries: list | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs` list for prompt `ids` with their engine `entries`."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for tid, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        top = e[1][:k]
        ranks = {t: r for r, (t, _) in reversed(list(enumerate(top, 1)))}
        d = {str(tid): {"logprob": _lp(e[0]), "rank": ranks.get(tid), "decoded_token": text(tid)}}
        for r, (t, v) in enumerate(top, 1):
            d.setdefault(str(t), {"logprob": _lp(v), "rank": r, "decoded_token": text(t)})
        out.append(d)
    return out
