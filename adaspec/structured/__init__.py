"""Structured outputs: a request's `StructuredOutput` (spec.py, pure), compiled by xgrammar
into a per-request matcher (grammar.py), whose token bitmask constrains every row a step
samples or verifies (bitmask.py). xgrammar is imported only when a grammar is used."""
from adaspec.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
