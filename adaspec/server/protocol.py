"""OpenAI request bodies (pydantic) and the error type every 4xx/5xx answer is built from.

Contract:
  * Models validate *types* strictly (a string where a number belongs is a 400, not a silent
    conversion); *ranges* of sampling values are checked by `SamplingParams.validate`, so the
    server and the offline API reject exactly the same values.
  * Unknown fields are ignored, as OpenAI-compatible servers usually do, so clients that send
    vendor extras keep working. Known OpenAI fields that adaspec does not implement are
    accepted only at their neutral value (e.g. `suffix: null`); anything else is a 400 naming
    the field, rather than silently returning something different.
  * Extras beyond OpenAI (vLLM spelling): top_k, min_p, repetition_penalty, min_tokens,
    ignore_eos, stop_token_ids, speculate (per-request opt-out of speculation),
    max_draft_tokens, return_token_ids, structured_outputs / guided_*, chat_template_kwargs,
    add_generation_prompt, continue_final_message, stream_options.continuous_usage_stats,
    include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
    truncate_prompt_tokens, allowed_token_ids, bad_words, prompt_logprobs,
    return_tokens_as_token_ids, add_special_tokens, cache_salt, request_id, chat `echo`.
    vLLM extras adaspec does not implement (use_beam_search, length_penalty, priority, a
    per-request chat_template, documents) are a 400 unless at their neutral value; unknown
    fields are logged once per name (server/body.py). The README's table says what each
    field does.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Integers are bounded to what the engine's tensors and generators can hold, so an absurd value is
# a 400 here rather than an overflow inside a batched step (which would fail other requests too).
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
# Stop conditions are checked on every emitted token (and text is held back by the longest
# stop string), so their number and length are capped; OpenAI itself allows 4 stop strings.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_STRING_CHARS)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]  # torch.Generator.manual_seed's range
Number = Union[Int64, StrictFloat]


class APIError(Exception):
    """An OpenAI-style error: rendered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False   # vLLM: usage so far on every chunk


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    max_tokens: Int64 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: Int64 = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    # adaspec / vLLM extras
    top_k: Int64 | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: Int64 | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[Int64], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    speculate: StrictBool = True
    max_draft_tokens: Int64 | None = None
    return_token_ids: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: Int64 | None = None
    allowed_token_ids: Annotated[list[Int64], Field(max_length=1 << 20)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    prompt_logprobs: Int64 | None = None
    return_tokens_as_token_ids: StrictBool | None = None   # None: the server's --return-tokens-as-token-ids
    add_special_tokens: StrictBool | None = None   # completions: true; chat: false (the template writes them)
    cache_salt: StrictStr | None = None
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    # vLLM fields whose non-default values adaspec does not implement (a 400 names them)
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0
    priority: Int64 = 0
    # Structured outputs (server/structured_request.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* spelling.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def unsupported_vllm(self) -> tuple[str, str] | None:
        """(param, message) of a vLLM extra set to a value adaspec does not implement."""
        if self.use_beam_search:
            return "use_beam_search", "beam search is not supported"
        if self.length_penalty != 1.0:
            return "length_penalty", "length_penalty applies to beam search, which is not supported"
        if self.priority != 0:
            return "priority", "priority scheduling is not supported (the scheduler is first come, first served)"
        return None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (OpenAI sends them as strings); APIError if not."""
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                out[int(k)] = float(v)
            except ValueError:
                raise APIError(f"logit_bias: key {k!r} is not a token id", param="logit_bias") from None
        return out


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids, or a
    list of token-id lists; each prompt becomes one choice (index = position in the list)."""

    prompt: StrictStr | list[StrictStr] | list[Int64] | list[list[Int64]]
    echo: StrictBool = False
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field set to a value adaspec does not implement."""
        if self.best_of not in (None, self.n):
            return "best_of", "best_of must equal n (or be omitted)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return self.unsupported_vllm()


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Strict):
    name: StrictStr
    arguments: StrictStr = ""


class ToolCall(_Strict):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None     # assistant turns that called tools
    tool_call_id: StrictStr | None = None        # tool turns: the call they answer

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)   # (parts one per line, as vLLM renders them)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template applied to
    `messages` with add_generation_prompt=True. `max_completion_tokens` wins over the legacy
    `max_tokens` when both are given."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Int64 | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # vLLM extras for the chat template
    functions: list[Any] | None = None       # OpenAI's deprecated spelling of tools: refused
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False                 # vLLM: start the answer with the last message's content
    chat_template: StrictStr | None = None   # vLLM: a per-request template (refused, see below)
    documents: list[Any] | None = None
    # OpenAI fields that would change the answer and that adaspec does not implement: a 400
    # unless neutral (text only, no audio, no predicted output, no web search)
    modalities: list[StrictStr] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.functions or self.function_call is not None:
            field = "functions" if self.functions else "function_call"
            return field, f"{field} (deprecated by OpenAI) is not supported; use tools and tool_choice"
        if self.chat_template is not None:
            return "chat_template", ("a chat template per request is not accepted (it runs code of the client's "
                                     "choosing in the server); start the server with --chat-template instead")
        if self.documents:
            return "documents", "documents (RAG inputs to the chat template) are not supported"
        if self.modalities not in (None, ["text"]):
            return "modalities", "only text output is supported (modalities: [\"text\"])"
        for field in ("audio", "prediction", "web_search_options"):
            if getattr(self, field) is not None:
                return field, f"{field} is not supported"
        return self.unsupported_vllm()
