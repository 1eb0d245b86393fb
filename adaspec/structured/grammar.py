"""Grammars through xgrammar: `GrammarCache` compiles a `StructuredOutput` once per distinct
value (schemas repeat across requests: a client sends the same one every time) and hands each
request its own `RequestGrammar`, the matcher that follows the request's emitted tokens.

JSON is compiled without free whitespace (compact separators `, ` and `: `): the output is
valid JSON either way, and free whitespace lets a model wander in an endless run of spaces
and newlines that the grammar cannot end (a known failure of small and quantized models).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict

from adaspec.structured.spec import StructuredOutput

log = logging.getLogger("adaspec")

CACHE_SIZE = 256
_LOOSE_CHAR = '[^\\"\\\\\\r\\n]'      # [^\"\\\r\n] as xgrammar prints it
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\]'


class RequestGrammar:
    """One request's matcher. `accept(token)` advances it by an emitted token (False: the token
    breaks the grammar, which masking makes impossible); `done` once the grammar is complete
    and its stop token accepted. The matcher never holds draft tokens: a step's masks are
    filled from the matcher's state plus each node's draft path (`structured.bitmask`)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size   # the bitmask's width (the grammar's vocabulary)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())


class GrammarCache:
    """Compiled grammars for one vocabulary. `vocab_size` is the model's (its logits' width,
    often larger than the tokenizer's); `stop_token_ids` end a complete output."""

    def __init__(self, tokenizer_info, max_threads: int = 1):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self.compiled: OrderedDict = OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> "GrammarCache":
        import xgrammar as xgr

        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids) or None))

    @classmethod
    def from_vocab(cls, pieces: list[str], stop_token_ids: list[int]) -> "GrammarCache":
        """A vocabulary of raw strings (token i = pieces[i]): tokenizer-free models, tests."""
        import xgrammar as xgr

        return cls(xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=len(pieces),
                                     stop_token_ids=stop_token_ids))

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`; ValueError when it does not compile."""
        hit = self.compiled.get(spec)
        if hit is not None:
            self.compiled.move_to_end(spec)
            return hit
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{spec.kind}: cannot compile it into a grammar: {e}") from None
        self.compiled[spec] = grammar
        if len(self.compiled) > CACHE_SIZE:
            self.compiled.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutput):
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            g = self.xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            # xgrammar (0.2.9) writes length-bounded strings (maxLength) with a character class
            # that lets raw control characters through, which JSON forbids: exclude them as its
            # unbounded strings do.
            return c.compile_grammar(str(g).replace(_LOOSE_CHAR, _JSON_CHAR))
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            # EBNF string literals take JSON's escapes.
            alts = " | ".join(json.dumps(s) for s in json.loads(spec.value))
            return c.compile_grammar(f"root ::= {alts}")
        return c.compile_grammar(spec.value)

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(self.xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)
