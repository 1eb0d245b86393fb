"""The `--configs` of `adaspec compare`: which servers to start, under which names.

The full form is JSON (a list, or a .json file holding one), one object per server:

    [{"label": "chain3", "policy": "always", "flags": ["--num-steps", "3"]},
     {"policy": "threshold:8"},
     {"label": "idle", "policy": "always", "request": {"speculate": false}}]

("request": fields added to every request body of that configuration). The short form below
remains for quick comparisons (`off,always,auto`); both give the same `ServerConfig`s.

    CONFIGS := ITEM ("," ITEM)*
    ITEM    := [LABEL "="] POLICY ["[" FLAGS "]"]
    POLICY  := off | always | auto | threshold:N
    LABEL   := a letter, digit or "_", then letters, digits, "_", ".", "+", "-"
    FLAGS   := `adaspec serve` flags, split like a shell line (brackets only inside quotes),
               and optionally --request-json JSON: an object whose fields `compare` adds to
               every request body of this configuration (not a server flag)

Examples::

    off,always,threshold:8,auto                                   (the original form)
    off,chain3=always[--num-steps 3 --topk 1],tree16=always[--num-steps 2 --topk 4 --num-draft-tokens 16]
    thr32=threshold:32[--num-steps 3 --topk 1],auto=auto[--num-steps 4]
    idle=always[--request-json '{"speculate": false}']      (draft loaded, every request opts out)

Commas inside brackets belong to the flags; quoted text there may hold anything. A
configuration without a label is named by its policy text ("threshold:8"); labels must be
unique. The flags are parsed with the server's own
argument parser (typos fail before any server starts) and override the flags `compare`
passes to every server; they may not set what the configuration itself decides
(--speculation, --spec-disable-batch-size) or what `compare` decides (--model, --host, --port).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass

POLICY_NAMES = ("off", "always", "auto")
LABEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
#: serve-parser destinations a configuration's flags may not set, and why.
RESERVED_DESTS = {
    "speculation": "the configuration's policy sets it",
    "spec_disable_batch_size": "threshold:N sets it",
    "model": "compare passes --model to every server",
    "model_tag": "compare passes --model to every server",
    "host": "compare picks the address",
    "port": "compare picks the port",
}


@dataclass(frozen=True)
class ServerConfig:
    """One configuration of `adaspec compare`: its label, policy (`threshold` carries
    `disable_bs`) and its own server flags."""

    label: str
    policy: str
    disable_bs: int | None = None
    flags: tuple[str, ...] = ()          # server flags
    request_json: str | None = None      # JSON object merged into every request body

    @property
    def policy_text(self) -> str:
        return f"threshold:{self.disable_bs}" if self.policy == "threshold" else self.policy

    @property
    def request_fields(self) -> dict:
        return json.loads(self.request_json) if self.request_json else {}

    def to_text(self) -> str:
        """This configuration in the `--configs` language (parses back to an equal object)."""
        text = self.policy_text if self.label == self.policy_text else f"{self.label}={self.policy_text}"
        words = list(self.flags) + (["--request-json", self.request_json] if self.request_json else [])
        return text + (f"[{shlex.join(words)}]" if words else "")


def parse_policy(text: str) -> tuple[str, int | None]:
    """'off' | 'always' | 'auto' | 'threshold:N' -> (policy, spec_disable_batch_size)."""
    name, _, arg = text.strip().partition(":")
    if name in POLICY_NAMES:
        if arg:
            raise ValueError(f"configuration {text!r} takes no argument")
        return name, None
    if name == "threshold":
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"configuration {text!r}: use threshold:N with an integer N") from None
        if n < 1:
            raise ValueError(f"configuration {text!r}: N must be >= 1")
        return name, n
    raise ValueError(f"unknown configuration {text!r}: use off, always, threshold:N or auto")


def _bracket_end(text: str, start: int) -> int:
    """Index of the ']' closing the '[' at `start`; quoted text (as shlex reads it) inside the
    brackets may hold any character. Raises ValueError if the brackets do not close or nest."""
    quote = None
    i = start + 1
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "[":
            raise ValueError(f"--configs: nested '[' in {text!r} (quote it)")
        elif ch == "]":
            return i
        i += 1
    raise ValueError(f"--configs: '[' without ']' in {text!r}")


def split_items(text: str) -> list[str]:
    """Split at the commas outside brackets; brackets must pair up and not nest (quoted text
    inside them is free)."""
    items, start, i = [], 0, 0
    while i < len(text):
        if text[i] == "[":
            i = _bracket_end(text, i)
        elif text[i] == "]":
            raise ValueError(f"--configs: ']' without '[' in {text!r}")
        elif text[i] == ",":
            items.append(text[start:i])
            start = i + 1
        i += 1
    items.append(text[start:])
    return [i.strip() for i in items if i.strip()]


def parse_item(item: str) -> ServerConfig:
    """One ITEM of the grammar above."""
    head, flags = item.strip(), ()
    if "[" in head:
        open_at = head.index("[")
        close_at = _bracket_end(head, open_at)
        body, tail = head[open_at + 1:close_at], head[close_at + 1:]
        if tail.strip():
            raise ValueError(f"configuration {item!r}: nothing may follow ']'")
        try:
            flags = tuple(shlex.split(body))
        except ValueError as e:
            raise ValueError(f"configuration {item!r}: bad flags ({e})") from None
        head = head[:open_at].strip()
        if not head:
            raise ValueError(f"configuration {item!r}: flags without a policy")
    elif "]" in head:
        raise ValueError(f"--configs: ']' without '[' in {item!r}")
    label = None
    if "=" in head:
        label, _, head = head.partition("=")
        label, head = label.strip(), head.strip()
        if not LABEL_RE.fullmatch(label):
            raise ValueError(f"configuration {item!r}: bad label {label!r} (letters, digits and "
                             "_ . + -, not starting with . + -)")
        if label in POLICY_NAMES and label != head:
            raise ValueError(f"configuration {item!r}: the label {label!r} names another policy")
    policy, n = parse_policy(head)
    text = f"threshold:{n}" if policy == "threshold" else policy
    flags, request_json = _take_request_json(item, flags)
    return ServerConfig(label=label or text, policy=policy, disable_bs=n, flags=flags,
                        request_json=request_json)


def _take_request_json(item: str, flags: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """Split --request-json JSON (or --request-json=JSON) off the server flags; the JSON must be
    an object. Returns (server flags, canonical JSON text or None)."""
    rest: list[str] = []
    found: list[str] = []
    i = 0
    while i < len(flags):
        w = flags[i]
        if w == "--request-json":
            if i + 1 >= len(flags):
                raise ValueError(f"configuration {item!r}: --request-json needs a JSON object")
            found.append(flags[i + 1])
            i += 2
            continue
        if w.startswith("--request-json="):
            found.append(w.split("=", 1)[1])
        else:
            rest.append(w)
        i += 1
    if not found:
        return tuple(rest), None
    if len(found) > 1:
        raise ValueError(f"configuration {item!r}: --request-json given twice")
    try:
        obj = json.loads(found[0])
    except ValueError as e:
        raise ValueError(f"configuration {item!r}: --request-json is not JSON ({e})") from None
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"configuration {item!r}: --request-json must be a non-empty JSON object")
    return tuple(rest), json.dumps(obj, sort_keys=True)


JSON_KEYS = ("label", "policy", "flags", "request")


def parse_json_item(obj, i: int) -> ServerConfig:
    """One object of the JSON form: {"label"?: str, "policy": "off|always|auto|threshold:N",
    "flags"?: [str] (or one shell-quoted string), "request"?: {fields added to every request}}."""
    where = f"--configs item {i}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, got {obj!r}")
    unknown = sorted(set(obj) - set(JSON_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (use {', '.join(JSON_KEYS)})")
    if not isinstance(obj.get("policy"), str):
        raise ValueError(f"{where}: \"policy\" must be one of off, always, auto, threshold:N")
    policy, n = parse_policy(obj["policy"])
    text = f"threshold:{n}" if policy == "threshold" else policy
    label = obj.get("label", text)
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
        raise ValueError(f"{where}: bad label {label!r} (letters, digits and _ . + -, not starting with . + -)")
    flags = obj.get("flags", [])
    if isinstance(flags, str):
        flags = shlex.split(flags)
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ValueError(f"{where}: \"flags\" must be a list of strings")
    request = obj.get("request")
    if request is not None and (not isinstance(request, dict) or not request):
        raise ValueError(f"{where}: \"request\" must be a non-empty object")
    return ServerConfig(label=label, policy=policy, disable_bs=n, flags=tuple(flags),
                        request_json=json.dumps(request, sort_keys=True) if request else None)


def parse_configs(text: str) -> list[ServerConfig]:
    """The whole `--configs` value: a JSON list of objects (`parse_json_item`), the path of a
    .json file holding one, or the short form above; raises ValueError with a message fit for
    argparse."""
    stripped = text.strip()
    if stripped.endswith(".json") and not stripped.startswith("["):
        try:
            with open(stripped) as f:
                stripped = f.read()
        except OSError as e:
            raise ValueError(f"--configs {text}: {e.strerror}") from None
    if re.match(r"\[\s*[{\]]", stripped):   # a JSON list ("[--topk 2]" is the short form's error)
        try:
            items = json.loads(stripped)
        except ValueError as e:
            raise ValueError(f"--configs is not valid JSON: {e}") from None
        configs = [parse_json_item(obj, i) for i, obj in enumerate(items)]
    else:
        configs = [parse_item(i) for i in split_items(text)]
    if not configs:
        raise ValueError("--configs is empty")
    seen: set[str] = set()
    for c in configs:
        if c.label in seen:
            raise ValueError(f"--configs repeats the label {c.label!r}; name each one, e.g. "
                             f"chain5={c.policy_text}[--num-steps 5]")
        seen.add(c.label)
    return configs


def raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, changed to raise ValueError(message) where it would print and exit, and to
    take only whole option names (argparse would read the typo --num-step as --num-steps)."""
    def error(message: str):
        raise ValueError(message)
    parser.error = error  # type: ignore[method-assign]
    parser.allow_abbrev = False
    return parser


def given_dests(parser: argparse.ArgumentParser, words: list[str]) -> dict[str, object]:
    """The destinations `words` set when parsed by `parser`, with their values (a flag given
    with its default value counts as given). Raises ValueError on a parse error."""
    parser = raising(parser)
    sentinel = object()
    dests = vars(parser.parse_args([]))
    try:
        ns = parser.parse_args(words, namespace=argparse.Namespace(**{d: sentinel for d in dests}))
    except SystemExit:  # --help, --version
        raise ValueError(f"{shlex.join(words)!r} exits the parser (help?)") from None
    # An optional positional (serve's MODEL) is always assigned: given only if not its default.
    unset_positionals = {a.dest for a in parser._actions if not a.option_strings
                         and getattr(ns, a.dest, None) == a.default}
    return {k: v for k, v in vars(ns).items() if v is not sentinel and k not in unset_positionals}


def check_flags(cfg: ServerConfig, serve_parser: argparse.ArgumentParser) -> dict[str, object]:
    """Parse a configuration's flags with the server's parser; returns the destinations they
    set. Raises ValueError for unknown flags, bad values and reserved destinations."""
    try:
        given = given_dests(serve_parser, list(cfg.flags))
    except ValueError as e:
        raise ValueError(f"configuration {cfg.label!r}: {e}") from None
    for dest, why in RESERVED_DESTS.items():
        if dest in given:
            raise ValueError(f"configuration {cfg.label!r}: --{dest.replace('_', '-')} cannot be "
                             f"set per configuration ({why})")
    return given
