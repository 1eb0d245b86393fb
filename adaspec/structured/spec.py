"""What a request asks its output to be: `StructuredOutput`, a frozen, picklable value that
travels with `SamplingParams` (to the engine process too). Pure: nothing here imports the
grammar engine; `structured.grammar` compiles it.

Kinds (the grammar each compiles to, through xgrammar):
    json         any JSON object (OpenAI `response_format: json_object`)
    json_schema  JSON valid under `value`, a JSON Schema as a JSON string (strict)
    regex        text matching the regular expression `value`
    choice       exactly one of the strings of `value` (a JSON list)
    grammar      the EBNF (GBNF) grammar `value`
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20   # a schema or grammar beyond this is an attack, not a format


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError saying what is wrong (the grammar itself is checked when compiled)."""
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output {self.kind}: the value must be a string of at most "
                             f"{MAX_SPEC_CHARS} characters")
        if self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"structured output {self.kind}: empty")
        if self.kind == "json_schema":
            schema = json.loads(self.value)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema: the schema must be a JSON object")
        if self.kind == "choice":
            choices = json.loads(self.value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice: must be a non-empty list of non-empty strings")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> "StructuredOutput":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices)))
