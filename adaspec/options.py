"""One definition per engine option: a frozen dataclass field whose metadata carries its
command-line flag(s), type, range and help. From those fields come

  * the checks (`check_fields`, called by each config's __post_init__): a wrong value is a
    ValueError naming the keyword AND the flag, e.g.
    "max_num_seqs (--max-num-seqs) must be >= 1, got 0";
  * the flags of `serve`, `generate` and `compare` (`add_option_args`), with help text that
    shows the default, vLLM's spelling first where vLLM has the option and adaspec's older
    spellings kept as aliases;
  * the mapping from parsed flags back to `EngineConfig.create` keywords (`kwargs_from_args`),
    which is also the `LLM(...)` vocabulary (field names, plus the `kw_aliases` of a field).

Value aliases (`values`, e.g. --dtype half -> float16) are normalized by `check_fields`, so
LLM(dtype="half") and --dtype half mean the same.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, field, fields
from typing import Any, Callable

_KEY = "adaspec_option"


def opt(default: Any, flag: str | None, help: str, *, type: type = str, ge: float | None = None,
        gt: float | None = None, le: float | None = None, choices: tuple | None = None,
        values: dict | None = None, check: Callable[[Any], str | None] | None = None,
        aliases: tuple[str, ...] = (), kw_aliases: tuple[str, ...] = (), negative_alias: str | None = None,
        default_text: str | None = None) -> Field:
    """A dataclass field that is an engine option. `flag` None: keyword only (no flag).
    `check(value)` returns what the value must be (a phrase) when it is wrong, else None.
    `negative_alias`: an old store_false spelling of a boolean (e.g. --no-prefix-caching).
    `default_text`: how the help states a default of None (e.g. "the model's")."""
    meta = dict(flag=flag, help=help, type=type, ge=ge, gt=gt, le=le, choices=choices, values=values or {},
                check=check, aliases=aliases, kw_aliases=kw_aliases, negative_alias=negative_alias,
                default_text=default_text)
    return field(default=default, metadata={_KEY: meta})


def option_fields(klass) -> list[tuple[Field, dict]]:
    return [(f, f.metadata[_KEY]) for f in fields(klass) if _KEY in f.metadata]


def _describe_range(m: dict) -> str:
    parts = []
    if m["ge"] is not None:
        parts.append(f">= {m['ge']:g}")
    if m["gt"] is not None:
        parts.append(f"> {m['gt']:g}")
    if m["le"] is not None:
        parts.append(f"<= {m['le']:g}")
    return " and ".join(parts)


def _problem(value: Any, m: dict) -> str | None:
    """What `value` must be, or None when it is fine (None is fine for a None default)."""
    t = m["type"]
    if t is bool:
        if not isinstance(value, bool):
            return "true or false"
        return None
    if t is int and (not isinstance(value, int) or isinstance(value, bool)):
        return "an integer"
    if t is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        return "a number"
    if t is str and not isinstance(value, str):
        return "a string"
    if m["choices"] is not None and value not in m["choices"]:
        return "one of " + ", ".join(map(str, m["choices"]))
    if t in (int, float):
        bad = ((m["ge"] is not None and not value >= m["ge"]) or (m["gt"] is not None and not value > m["gt"])
               or (m["le"] is not None and not value <= m["le"]))
        if bad:
            return _describe_range(m)
    if m["check"] is not None:
        return m["check"](value)
    return None


def option_name(f: Field, m: dict) -> str:
    """How errors name the option: "keyword (--flag)"."""
    if not m["flag"]:
        return f.name
    return f"{f.name} ({' or '.join((m['flag'], *m['aliases']))})"


def check_fields(obj) -> None:
    """Normalize value aliases and check every option field of `obj` (a frozen dataclass)."""
    for f, m in option_fields(type(obj)):
        value = getattr(obj, f.name)
        if isinstance(value, str) and value in m["values"]:
            value = m["values"][value]
            object.__setattr__(obj, f.name, value)
        if value is None and f.default is None:
            continue
        what = _problem(value, m)
        if what is not None:
            raise ValueError(f"{option_name(f, m)} must be {what}, got {value!r}")


def keyword_aliases(*klasses) -> dict[str, str]:
    """Other keyword spellings -> field name, over `klasses`: the `kw_aliases`, and every flag's
    own name (--spec-auto-profile: spec_auto_profile), so a flag's keyword always works."""
    out = {}
    for k in klasses:
        for f, m in option_fields(k):
            for a in (*m["kw_aliases"], *((dest_of(m),) if m["flag"] else ())):
                if a != f.name:
                    out[a] = f.name
    return out


def dest_of(m: dict) -> str:
    return m["flag"][2:].replace("-", "_")


def add_option_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *klasses) -> None:
    """One flag per option field of `klasses` (those with a flag), dest = the flag's name."""
    for k in klasses:
        for f, m in option_fields(k):
            if m["flag"] is None:
                continue
            default = f.default if f.default is not MISSING else None
            flags = [m["flag"], *m["aliases"]]
            help_ = m["help"]
            if m["values"]:
                help_ += " (" + ", ".join(f"{a} = {b}" for a, b in m["values"].items()) + ")"
            if m["type"] is bool:
                p.add_argument(*flags, dest=dest_of(m), action=argparse.BooleanOptionalAction, default=default,
                               help=f"{help_} (default: {'on' if default else 'off'})")
                if m["negative_alias"]:
                    p.add_argument(m["negative_alias"], dest=dest_of(m), action="store_false",
                                   help=f"same as --no-{m['flag'][2:]}")
                continue
            shown = m["default_text"] if default is None and m["default_text"] else default
            kw: dict = dict(dest=dest_of(m), default=default, help=f"{help_} (default: {shown})")
            if m["type"] in (int, float):
                kw["type"] = m["type"]
            if m["choices"] is not None:
                kw["choices"] = tuple(m["choices"]) + tuple(m["values"])
            p.add_argument(*flags, **kw)


def kwargs_from_args(a: argparse.Namespace, *klasses) -> dict:
    """The parsed flags of `add_option_args(p, *klasses)` as `EngineConfig.create` keywords,
    leaving out values that are None or the field's default (they change nothing)."""
    out = {}
    for k in klasses:
        for f, m in option_fields(k):
            value = getattr(a, dest_of(m), None) if m["flag"] is not None else None
            if value is not None and value != f.default:
                out[f.name] = value
    return out
