"""Incremental detokenization and stop strings.

Two ways to the same text (`tokenizer.decode(output ids)` with the request's
`skip_special_tokens`, default on, and `spaces_between_special_tokens`), a multi-byte
character split across tokens held back until it is complete:
  * fast tokenizers: a `tokenizers.decoders.DecodeStream` per request, fed each new token
    (about 2x cheaper per token than the window below: 6 vs 14 us on the demo tokenizer);
    `prefix_offset` is the first token whose text is not out yet;
  * otherwise, and for tokenizers that clean up spaces on decode (which DecodeStream does not
    do): a sliding window of output tokens (`prefix_offset:read_offset` is what was already
    shown, `prefix_offset:` what is new); the decoder yields U+FFFD until a character is whole.
"""
from __future__ import annotations

from adaspec.engine.request import Request

REPLACEMENT = "\ufffd"


def _text_options(req: Request) -> tuple[bool, bool]:
    """(skip_special_tokens, spaces_between_special_tokens) of the request (vLLM's defaults,
    both on, for params that do not carry them)."""
    p = req.params
    return getattr(p, "skip_special_tokens", True), getattr(p, "spaces_between_special_tokens", True)


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.backend = backend if backend is not None and not cleans else None

    def _decode(self, ids: list[int], req: Request) -> str:
        skip, spaces = _text_options(req)
        if skip or spaces:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)

    def update(self, req: Request, check_stop: bool = True, upto: int | None = None) -> bool:
        """Extend `req.text` with what the newest tokens spell (the first `upto` output tokens,
        default all). Returns True (and cuts the text before the stop string) if one of the
        request's stop strings has appeared (looked for only when `check_stop`: min_tokens
        suspends them)."""
        if self.backend is not None:
            return self._update_stream(req, check_stop, upto)
        ids = req.output_token_ids
        ids = ids if upto is None else ids[:upto]
        prefix = self._decode(ids[req.prefix_offset:req.read_offset], req)
        full = self._decode(ids[req.prefix_offset:], req)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            req.text += full[len(prefix):]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        if not check_stop:
            req.stop_checked_len = len(req.text)
            return False
        return self._check_stop(req)

    def _update_stream(self, req: Request, check_stop: bool = True, upto: int | None = None) -> bool:
        if req.decode_stream is None:
            from tokenizers.decoders import DecodeStream   # (a backend tokenizer means tokenizers is there)
            req.decode_stream = DecodeStream(skip_special_tokens=_text_options(req)[0])
        ids = req.output_token_ids
        n = len(ids) if upto is None else upto
        for i in range(req.read_offset, n):
            piece = req.decode_stream.step(self.backend, ids[i])
            if piece is not None:
                req.text += piece
                req.prefix_offset = i + 1
        req.read_offset = max(req.read_offset, n)
        if not check_stop:
            req.stop_checked_len = len(req.text)
            return False
        return self._check_stop(req)

    def flush(self, req: Request) -> None:
        """At the end: emit whatever is still held back (an incomplete character included)."""
        ids = req.output_token_ids
        if self.backend is not None:
            self._update_stream(req)
            if req.prefix_offset < len(ids):   # the bytes of an unfinished character
                req.text += self._decode(ids[req.prefix_offset:], req)
                req.prefix_offset = len(ids)
            return
        if req.read_offset < len(ids):
            prefix = self._decode(ids[req.prefix_offset:req.read_offset], req)
            req.text += self._decode(ids[req.prefix_offset:], req)[len(prefix):]
            req.prefix_offset = req.read_offset = len(ids)

    @staticmethod
    def _check_stop(req: Request) -> bool:
        """The earliest stop string in the text (the first listed at a tie) cuts it there, or
        after itself with `include_stop_str_in_output`; it becomes `req.stop_reason`."""
        stops = req.params.stop
        if not stops:
            return False
        start = max(0, req.stop_checked_len - max(len(s) for s in stops) + 1)
        hits = [(i, k) for k, i in enumerate(req.text.find(s, start) for s in stops) if i >= 0]
        req.stop_checked_len = len(req.text)
        if hits:
            at, k = min(hits)
            stop = stops[k]
            include = getattr(req.params, "include_stop_str_in_output", False)
            req.text = req.text[:at + len(stop) if include else at]
            req.stop_reason = stop
            return True
        return False
