"""Tokenizers and prompts: what the engine, the HTTP API, `adaspec generate` and the trainer
share, so that all of them see the same tokens.

  * Text prompts are encoded WITH the tokenizer's special tokens (a BOS where the tokenizer's
    post-processor adds one), as Hugging Face and OpenAI-compatible servers do for completions.
  * Chat prompts are rendered by the tokenizer's chat template with add_generation_prompt=True
    and encoded WITHOUT special tokens, because the template already writes them.
"""
from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | None, chat_template: str | None = None):
    """The tokenizer in directory `path` (None when it holds none). `chat_template` (a file
    or the Jinja text itself, as vLLM's --chat-template takes) replaces the tokenizer's own."""
    if path is None or not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(value: str) -> str:
    """`value` itself when it holds Jinja markup, else the text of the file it names."""
    if ("{{" in value or "{%" in value) and not Path(value).is_file():
        return value
    return Path(value).read_text()


def tokenize(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompt given but the model directory has no tokenizer; pass token ids")
        return tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt must be a string or a list of integer token ids")
    return list(prompt)


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens` = k: the prompt's last k tokens (-1: as many as the context
    holds with one left to generate; None: all)."""
    if k is None:
        return ids
    if k < 1 and k != -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the context's limit) or an integer >= 1, got {k}")
    return ids[-(max_model_len - 1 if k == -1 else k):]


MAX_BAD_WORD_TOKENS = 64   # a verify step checks every word's tokens at every node: bounded


def bad_word_ids(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """The token sequences `SamplingParams.bad_words` bans: each word as the model writes it
    at the start of the text and after a space (its leading spaces dropped first), without
    special tokens; a spelling that is the same sequence counts once. ValueError for a word
    of more than MAX_BAD_WORD_TOKENS tokens."""
    if tokenizer is None:
        raise ValueError("bad_words need the model's tokenizer")
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words: {word[:40]!r} is {len(ids)} tokens, more than the limit of "
                                 f"{MAX_BAD_WORD_TOKENS}")
            if ids and ids not in out:
                out.append(ids)
    return out


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> str:
    """The chat template's text for `messages`; `template_kwargs` go to the template (tools,
    add_generation_prompt (default True), continue_final_message, and any the template reads)."""
    kw = {"add_generation_prompt": True, **(template_kwargs or {})}
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def encode_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Raises ValueError if there is no chat template; the template's own errors pass through."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template")
    return list(tokenizer.encode(render_chat(tokenizer, messages, template_kwargs), add_special_tokens=False))
