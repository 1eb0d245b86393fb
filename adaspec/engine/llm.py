"""The offline API: `LLM.generate` runs the engine's step loop until every prompt is done."""
from __future__ import annotations

from adaspec.config import SchedulerConfig
from adaspec.engine.engine import Engine
from adaspec.engine.request import RequestOutput
from adaspec.models.quantized import check_requested
from adaspec.sampling import SamplingParams
from adaspec.tokenization import encode_chat


class LLM:
    """Offline batch generation.

        llm = LLM("path/to/model", device="cpu", dtype="float32")
        outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0.0))

    A prompt is text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.

    Sampling defaults: `generate(prompts)` without SamplingParams uses
    `llm.default_sampling_params()`, i.e. the model's generation_config.json (temperature,
    top_p, top_k, min_p, penalties) unless the LLM was built with generation_config="none". A
    SamplingParams you construct yourself is used exactly as given (as in vLLM);
    `llm.default_sampling_params(max_tokens=64)` gives the model's defaults plus your fields.
    With `n` > 1 a prompt has n outputs, in order (prompt-major): choice i is what n = 1
    with seed + i returns; the choices share the prompt's KV through the prefix cache.
    """

    MAX_STALLED_STEPS = 100

    def __init__(self, model: str, **kwargs):
        check_requested(kwargs.pop("quantization", None), model)   # vLLM's keyword: the checkpoint's own method
        _take_vllm_keywords(kwargs)
        # Offline, throughput is the figure: next to decode rows, prefill takes the step's whole
        # budget unless `long_prefill_token_threshold` says otherwise. (The server paces prefill
        # by measurement to keep streams' inter-token latency, engine/prefill_pacer.py. Offline,
        # 256 requests of 512 tokens at once on the Qwen3-30B-A3B shape made 3,875 tok/s paced
        # on the H200, where the same run made 6,266 before the pacer existed.)
        kwargs.setdefault("long_prefill_token_threshold",
                          kwargs.get("max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens))
        self.engine = Engine.from_kwargs(model, **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's spelling; None for a model directory without one)."""
        return self.engine.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """`generate` over chat conversations (vLLM's `LLM.chat`): each conversation, a list of
        {"role", "content"} messages (or one conversation), rendered by the tokenizer's chat
        template; `tools` and the keywords go to the template. ValueError without a template."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list) or not messages or not all(isinstance(c, list) and c for c in messages):
            raise ValueError("messages must be a non-empty list of messages, or a list of such conversations")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: set add_generation_prompt=False")
        kw = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message}
        if tools is not None:
            kw["tools"] = tools
        prompts = [encode_chat(self.engine.tokenizer, conv, kw) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        return self.engine.default_sampling_params(**overrides)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        prompts = [_prompt_of(p) for p in prompts]
        params = sampling_params if sampling_params is not None else self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # n > 1: each choice is a request of its own (seed + index), right after its siblings;
        # the outputs come prompt-major (prompt 0's n choices, then prompt 1's ...).
        pairs = [(pr, c) for pr, p in zip(prompts, params) for c in p.choices()]
        prompts, params = [pr for pr, _ in pairs], [c for _, c in pairs]
        base = next(self.engine._ids)
        ids = [f"llm-{base}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                added.append(self.engine.add_request(rid, prompt, p))
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
            if not self.engine.has_unfinished() and len(done) < len(ids):
                raise RuntimeError("engine stopped with unfinished requests")
            if self.engine.num_stalled_steps >= self.MAX_STALLED_STEPS:
                for rid in ids:
                    self.engine.abort_request(rid)
                raise RuntimeError(f"the engine made no progress in {self.MAX_STALLED_STEPS} steps with "
                                   f"{len(ids) - len(done)} requests unfinished (a scheduler bug)")
        if bar:
            bar.close()
        return [done[r] for r in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); also done at exit."""
        self.engine.close()


def _prompt_of(p):
    """A prompt as the engine takes it: text or token ids; vLLM's dict forms too
    ({"prompt": text} / {"prompt_token_ids": ids})."""
    if not isinstance(p, dict):
        return p
    keys = set(p) & {"prompt", "prompt_token_ids"}
    if len(keys) != 1 or set(p) - {"prompt", "prompt_token_ids", "multi_modal_data"} or p.get("multi_modal_data"):
        raise ValueError(f"a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids', got {sorted(p)}")
    return p[keys.pop()]


# vLLM's LLM(...) keywords that scripts pass, accepted where adaspec already behaves as they ask:
# name -> (whether a value is fine, what adaspec does instead).
_VLLM_KEYWORDS = {
    "trust_remote_code": (lambda v: isinstance(v, bool), "adaspec implements each architecture and runs no checkpoint code"),
    "disable_log_stats": (lambda v: isinstance(v, bool), "LLM logs no periodic stats"),
    "swap_space": (lambda v: isinstance(v, (int, float)) and v >= 0, "preempted requests are recomputed, not swapped"),
    "revision": (lambda v: v is None, "models load from local directories only"),
    "enable_chunked_prefill": (lambda v: v in (None, True), "prefill is always chunked"),
    "kv_cache_dtype": (lambda v: v in (None, "auto"), "the KV cache is kept in the model's dtype"),
    "tokenizer_mode": (lambda v: v in (None, "auto"), "the tokenizer is transformers' AutoTokenizer"),
    "max_logprobs": (lambda v: isinstance(v, int) and 0 <= v <= 20, "a request asks for at most 20 alternatives"),
}


def _take_vllm_keywords(kwargs: dict) -> None:
    """Remove vLLM's keywords from `kwargs`; ValueError for a value adaspec cannot honour."""
    for name, (ok, instead) in _VLLM_KEYWORDS.items():
        if name in kwargs and not ok(kwargs.pop(name)):
            raise ValueError(f"{name}: this value is not supported ({instead})")
