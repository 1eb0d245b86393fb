"""Incremental detokenization and stop strings.

Text is decoded from a sliding window of output tokens (`prefix_offset:read_offset` is what
was already shown, `prefix_offset:` what is new), so a multi-byte character split across
tokens is held back until it is complete (the decoder yields U+FFFD until then).
"""
from __future__ import annotations

from adaspec.engine.request import Request

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, req: Request) -> bool:
        """Extend `req.text` with what the newest tokens spell. Returns True (and cuts the text
        before the stop string) if one of the request's stop strings has appeared."""
        ids = req.output_token_ids
        prefix = self._decode(ids[req.prefix_offset:req.read_offset])
        full = self._decode(ids[req.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            req.text += full[len(prefix):]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        return self._check_stop(req)

    def flush(self, req: Request) -> None:
        """At the end: emit whatever is still held back (an incomplete character included)."""
        ids = req.output_token_ids
        if req.read_offset < len(ids):
            prefix = self._decode(ids[req.prefix_offset:req.read_offset])
            req.text += self._decode(ids[req.prefix_offset:])[len(prefix):]
            req.prefix_offset = req.read_offset = len(ids)

    @staticmethod
    def _check_stop(req: Request) -> bool:
        stops = req.params.stop
        if not stops:
            return False
        start = max(0, req.stop_checked_len - max(len(s) for s in stops) + 1)
        hits = [i for i in (req.text.find(s, start) for s in stops) if i >= 0]
        req.stop_checked_len = len(req.text)
        if hits:
            req.text = req.text[:min(hits)]
            return True
        return False
