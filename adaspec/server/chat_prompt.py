"""Chat prompts from untrusted messages: special-token text a client types into a message
(`</s>`, `<|im_start|>`, ...) stays text; only the chat template writes control tokens.

Hugging Face tokenizers parse special-token text anywhere in the string they encode, and the
chat template's output is one string holding the template's markup and the messages' content
together, so a user could end their turn, or start a system turn, by typing it (a
prompt-injection vector). `encode_chat_untrusted`:
  * content without special-token text (the usual case): exactly `tokenization.encode_chat`,
    the tokens every other path (the engine, `adaspec generate --chat`) produces;
  * otherwise the content's place in the rendered prompt is found by rendering it as a
    sentinel, the prompt is cut at the special tokens the TEMPLATE wrote (the same cuts the
    tokenizer itself makes around special tokens), and every piece between them is encoded
    with special tokens split, so the content's `</s>` becomes the tokens of the text "</s>".
    A template that does not insert such content verbatim (it trims it, say) cannot be told
    apart from the content, and the request is refused (ValueError -> 400).
"""
from __future__ import annotations

import re
import secrets

from adaspec.tokenization import encode_chat, render_chat


def special_token_texts(tokenizer) -> dict[str, object]:
    """{text: AddedToken} of the tokenizer's special added tokens."""
    out = {}
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False) and tok.content:
            out[tok.content] = tok
    return out


def encode_chat_untrusted(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the chat prompt for `messages` ({"role", "content"} dicts, content a str)
    where no message content can produce a special (control) token. ValueError when the
    template rejects the messages or inserts content with special-token text other than
    verbatim. `template_kwargs`: as `tokenization.render_chat`."""
    specials = special_token_texts(tokenizer)
    marked = [i for i, m in enumerate(messages) if any(s in (m.get("content") or "") for s in specials)]
    if not marked:
        return encode_chat(tokenizer, messages, template_kwargs)

    def render(msgs: list[dict]) -> str:
        return render_chat(tokenizer, msgs, template_kwargs)

    text = render(messages)
    nonce = secrets.token_hex(8)
    sentinels = {i: f"ADASPECCONTENT{nonce}N{i}X" for i in marked}
    skeleton = render([{**m, "content": sentinels[i]} if i in sentinels else m for i, m in enumerate(messages)])
    # Rebuild the prompt from the skeleton with the real content, recording where it lies.
    spans, rebuilt, pos = [], "", 0
    for i in marked:
        at = skeleton.find(sentinels[i], pos)
        if at < 0 or skeleton.count(sentinels[i]) != 1:
            break
        rebuilt += skeleton[pos:at]
        spans.append((len(rebuilt), len(rebuilt) + len(messages[i]["content"])))
        rebuilt += messages[i]["content"]
        pos = at + len(sentinels[i])
    rebuilt += skeleton[pos:]
    if len(spans) != len(marked) or rebuilt != text:
        raise ValueError("a message contains special-token text (such as "
                         f"{next(s for s in specials if s in messages[marked[0]]['content'])!r}) "
                         "and this model's chat template does not insert message content verbatim, "
                         "so it cannot be kept as text; remove it")

    def plain(piece: str) -> list[int]:
        return list(tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)) if piece else []

    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    cursor = 0
    for m in pattern.finditer(text):
        if any(a < m.end() and m.start() < b for a, b in spans):
            continue   # written (at least partly) by the client: text
        tok = specials[m.group()]
        before = text[cursor:m.start()]
        ids += plain(before.rstrip() if getattr(tok, "lstrip", False) else before)
        ids.append(tokenizer.convert_tokens_to_ids(m.group()))
        cursor = m.end()
        if getattr(tok, "rstrip", False):
            cursor += len(text[cursor:]) - len(text[cursor:].lstrip())
    return ids + plain(text[cursor:])
