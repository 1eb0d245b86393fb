"""Reasoning text in a chat answer (`--reasoning-parser`, vLLM's names): the part inside
`<think>` ... `</think>` goes to the message's `reasoning_content`, the rest is its `content`
(tool calls are then read out of the content only).

    deepseek_r1   DeepSeek-R1 and its distills: the answer is reasoning up to </think> whether
                  or not it opens <think> (their templates open it)
    qwen3         Qwen3, QwQ: reasoning when the answer opens <think>, or when the prompt ends
                  with <think> (templates of thinking models open it there); otherwise, as with
                  enable_thinking=False, the answer is all content
    glm45         GLM-4.5 / 4.6: as qwen3

`split(text, finished)` is a pure function of the answer so far: while it runs, a tag cut in
half at the end is held back, so a stream's reasoning and content deltas add up to the final
split.
"""
from __future__ import annotations

from dataclasses import dataclass

from adaspec.server.tool_parsers import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool = False   # the template always opens <think>: answers start in reasoning

    def split(self, text: str, finished: bool, prompt_opened: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the answer so far ("" where there is none). `prompt_opened`:
        this request's prompt ends with <think> (a thinking template opened it)."""
        lead = len(text) - len(text.lstrip())
        if not finished and text[lead:] and START.startswith(text[lead:]) and text[lead:] != START:
            return "", ""                      # "<thi": may still open reasoning
        tag = text[lead:].startswith(START)
        if not (tag or prompt_opened or self.opens_in_prompt):
            return "", text
        body = text[lead + len(START):] if tag else text
        end = body.find(END)
        if end >= 0:
            return body[:end].strip(), body[end + len(END):].lstrip("\n")
        hold = 0 if finished else partial_suffix(body, END)
        return body[:len(body) - hold].strip(), ""


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", opens_in_prompt=True),
                     "qwen3": ReasoningParser("qwen3"), "glm45": ReasoningParser("glm45")}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def opens_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the chat prompt ends inside <think> (the template of a thinking model opened it)."""
    if tokenizer is None or not prompt_ids:
        return False
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    return tail.endswith(START)
