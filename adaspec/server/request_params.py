"""An OpenAI request body's sampling fields -> the engine's `SamplingParams`, one per choice
(`prepare_choices`): the server's defaults (see `server/serving.py`) filled in, the ranges
checked by `SamplingParams.validate` (so the server and the offline API refuse the same
values), every failure an APIError naming the field.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from adaspec.sampling import SamplingParams
from adaspec.server.info import BUILTIN_SAMPLING_DEFAULTS
from adaspec.server.protocol import APIError, ChatCompletionRequest
from adaspec.tokenization import truncate_prompt

logger = logging.getLogger("adaspec.server")

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "max_draft_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "prompt_logprobs", "n",
                   "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                   "allowed_token_ids", "bad_words", "cache_salt")


@dataclass
class Prepared:
    """One choice of one prompt, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    tools: tuple = ("none", None)    # chat: (tool mode, named function) (server/structured_request.py)
    prompt_text: str | None = None   # what `echo` repeats
    echo_only: bool = False          # completions' echo with max_tokens 0: the prompt is the whole answer


def param_of(err: ValueError, default: str | None = None) -> str | None:
    """SamplingParams' messages start with the field name; use it as the OpenAI `param`."""
    first = str(err).split(" ", 1)[0].rstrip(":")
    return first if first in SAMPLING_FIELDS else default


def prepare_choices(aengine, req, prompt_ids: list[int], default_max_tokens: int, param: str,
                    structured=None) -> list[Prepared]:
    """The `n` choices (seed + index each) of one prompt of `req` for `aengine`'s model: its
    context limit, generation-config defaults and vocabulary; APIError naming the field that
    is wrong. `param`: the field the prompt came in; `structured`: the request's grammar."""
    limit = aengine.max_model_len
    if not prompt_ids:
        raise APIError("the prompt is empty", param=param)
    try:   # (before the length checks below; the engine's own check then finds nothing to cut)
        prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, limit)
    except ValueError as e:
        raise APIError(str(e), param="truncate_prompt_tokens") from None
    if len(prompt_ids) >= limit:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens, but the context limit is {limit} "
                       f"tokens and at least one must be left for the completion", param=param,
                       code="context_length_exceeded")
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    chat = isinstance(req, ChatCompletionRequest)
    # OpenAI's scoring form, which vLLM serves too: echo with max_tokens 0 answers with the prompt
    # (and its logprobs) alone. One token is generated, and dropped from the answer.
    echo_only = not chat and req.echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    explicit = max_tokens is not None
    if not explicit:
        max_tokens = min(default_max_tokens, limit - len(prompt_ids))
    defaults = {**BUILTIN_SAMPLING_DEFAULTS, **aengine.sampling_defaults}
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    # Asked for (vLLM's prompt_logprobs), and echo repeats the prompt's with its logprobs too.
    asked = [v for v in (req.prompt_logprobs, None if chat or not req.echo else req.logprobs) if v is not None]
    prompt_logprobs = max(asked) if asked else None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults["temperature"] if req.temperature is None else float(req.temperature),
            top_p=defaults["top_p"] if req.top_p is None else float(req.top_p),
            top_k=defaults["top_k"] if req.top_k is None else req.top_k,
            min_p=defaults["min_p"] if req.min_p is None else float(req.min_p),
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, speculate=req.speculate, max_draft_tokens=req.max_draft_tokens,
            **{f: float(defaults.get(f, neutral) if getattr(req, f) is None else getattr(req, f))
               for f, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                  ("repetition_penalty", 1.0))},
            logit_bias=req.logit_bias_ids(), min_tokens=req.min_tokens or 0,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=req.n, structured=structured,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, cache_salt=req.cache_salt)
    except ValueError as e:
        param = param_of(e)
        if chat and param == "logprobs":
            param = "top_logprobs"
        raise APIError(str(e), param=max_param if param == "max_tokens" else param) from None
    vocab = getattr(aengine, "vocab_size", None)
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        beyond = [t for t in ids if vocab is not None and t >= vocab]
        if beyond:
            raise APIError(f"{name}: token id {beyond[0]} is out of range [0, {vocab})", param=name)
    if explicit and len(prompt_ids) + max_tokens > limit:
        raise APIError(f"this model's maximum context length is {limit} tokens, but {len(prompt_ids)} "
                       f"prompt tokens + {max_param}={max_tokens} exceed it", param=max_param,
                       code="context_length_exceeded")
    return [Prepared(prompt_ids, c, echo_only=echo_only) for c in params.choices()]


def request_ids(prefix: str, req, headers) -> tuple[str, str]:
    """(the response's id, the engine's id for the request). vLLM's order: the X-Request-Id
    header, the body's `request_id`, a random one. A client's id need not be unique on this
    server, so the engine's gets a random suffix."""
    header = headers.get("x-request-id")
    if header is not None and (len(header) > 256 or not header.isprintable()):
        header = None   # (as the X-Request-Id middleware: only a plain, short token is taken)
    given = header or req.request_id
    rid = f"{prefix}-{given or uuid.uuid4().hex}"
    return rid, rid if given is None else f"{rid}-{uuid.uuid4().hex[:12]}"


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Most characters a prompt that fits the context can have: a token never covers more
    characters than its vocabulary string (byte-level BPE: one character per byte; a
    sentencepiece byte token `<0x41>` covers one), doubled for normalizers that compose
    characters. Longer text is refused without being tokenized. None: no bound known."""
    if tokenizer is None:
        return None
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max(len(p) for p in pieces if p is not None)
    except Exception:  # an unusual tokenizer: no bound beyond the body size limit
        logger.warning("could not bound prompt length from the vocabulary; relying on the body limit")
        return None
    return 2 * longest * max_model_len
