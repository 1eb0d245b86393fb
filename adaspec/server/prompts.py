"""Prompt encoding shared by the HTTP API and `adaspec generate`, so both see the same tokens.

  * Text prompts are encoded WITH the tokenizer's special tokens (a BOS where the tokenizer's
    post-processor adds one), as Hugging Face and OpenAI-compatible servers do for completions.
  * Chat prompts are rendered by the tokenizer's chat template with add_generation_prompt=True
    and encoded WITHOUT special tokens, because the template already writes them.
"""
from __future__ import annotations


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True))


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Raises ValueError if there is no chat template; the template's own errors pass through."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
