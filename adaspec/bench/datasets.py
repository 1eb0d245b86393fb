"""Benchmark prompts: seeded, indexable streams of requests.

Every dataset is an infinite, deterministic stream: request `i` depends only on the
dataset's arguments, its seed and `i`. The sweep takes warm-up requests from indices
`0..W-1` and level `j` from `W + j*N .. W + (j+1)*N - 1`, so levels never repeat a prompt
(no prefix-cache hits between levels) and two runs with the same seed - e.g. two server
configurations in `adaspec compare` - send exactly the same requests.

Datasets (see `load_dataset`):
  * ``random``        random token ids sent as a list-of-ints prompt (completions only);
  * ``PATH.jsonl``    Spec-Bench / MT-bench questions: the first entry of ``turns`` is the prompt;
  * ``code:DIR``      prompts cut from the Python files under DIR at line boundaries.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

TokenCounter = Callable[[str], int]

#: Characters per token assumed when a text prompt's length must be estimated without a tokenizer.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class SampleRequest:
    """One request to send. `prompt` is text or a list of token ids; `prompt_len` is its
    length in tokens (exact for token ids or with a tokenizer, else estimated as
    len(text) / CHARS_PER_TOKEN); `output_len` is the `max_tokens` to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


class Dataset(Protocol):
    name: str

    def sample(self, n: int, start: int = 0) -> list[SampleRequest]:
        """Requests `start .. start+n-1` of this dataset's deterministic stream."""
        ...


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean*(1-r), mean*(1+r)] (inclusive, at least 1), as `vllm bench`."""
    lo = max(1, int(round(mean * (1.0 - range_ratio))))
    hi = max(lo, int(round(mean * (1.0 + range_ratio))))
    return int(rng.integers(lo, hi + 1))


def _estimate_tokens(text: str, count_tokens: TokenCounter | None) -> int:
    if count_tokens is not None:
        return int(count_tokens(text))
    return max(1, (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN)


class RandomDataset:
    """Prompts of random token ids drawn uniformly from `[min_token_id, vocab_size)`.

    Input and output lengths are uniform in `len*(1-range_ratio) .. len*(1+range_ratio)`.
    `min_token_id` skips the low ids where tokenizers usually keep special tokens.
    """

    name = "random"

    def __init__(self, input_len: int, output_len: int, range_ratio: float = 0.0, *,
                 vocab_size: int = 256, min_token_id: int = 3, seed: int = 0) -> None:
        if input_len < 1 or output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        if vocab_size <= min_token_id:
            raise ValueError(f"vocab_size ({vocab_size}) must exceed min_token_id ({min_token_id})")
        self.input_len, self.output_len, self.range_ratio = input_len, output_len, range_ratio
        self.vocab_size, self.min_token_id, self.seed = vocab_size, min_token_id, seed

    def sample(self, n: int, start: int = 0) -> list[SampleRequest]:
        out = []
        for i in range(start, start + n):
            rng = np.random.default_rng([self.seed, i])
            in_len = _lengths(rng, self.input_len, self.range_ratio)
            out_len = _lengths(rng, self.output_len, self.range_ratio)
            ids = rng.integers(self.min_token_id, self.vocab_size, size=in_len).tolist()
            out.append(SampleRequest(prompt=ids, prompt_len=in_len, output_len=out_len))
        return out


class _TextDataset:
    """A finite list of text prompts, visited in a seeded random order, cycling."""

    name = "text"

    def __init__(self, prompts: Sequence[str], output_len: int, *, seed: int = 0,
                 count_tokens: TokenCounter | None = None) -> None:
        if not prompts:
            raise ValueError(f"dataset {self.name!r} has no prompts")
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {output_len}")
        self.prompts = list(prompts)
        self.output_len = output_len
        self.order = np.random.default_rng(seed).permutation(len(self.prompts))
        self.count_tokens = count_tokens
        self._lens: dict[int, int] = {}

    def _len(self, j: int) -> int:
        if j not in self._lens:
            self._lens[j] = _estimate_tokens(self.prompts[j], self.count_tokens)
        return self._lens[j]

    def sample(self, n: int, start: int = 0) -> list[SampleRequest]:
        out = []
        for i in range(start, start + n):
            j = int(self.order[i % len(self.order)])
            out.append(SampleRequest(prompt=self.prompts[j], prompt_len=self._len(j),
                                     output_len=self.output_len))
        return out


class JsonlDataset(_TextDataset):
    """Spec-Bench / MT-bench question files: one JSON object per line; the prompt is the
    first element of ``turns`` (objects with a plain ``prompt`` string are accepted too).
    Lines without either are an error, so a wrong file fails loudly."""

    def __init__(self, path: str | os.PathLike, output_len: int, *, seed: int = 0,
                 count_tokens: TokenCounter | None = None) -> None:
        self.name = f"jsonl:{path}"
        self.path = Path(path)
        prompts = []
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                turns = obj.get("turns")
                if isinstance(turns, list) and turns and isinstance(turns[0], str):
                    prompts.append(turns[0])
                elif isinstance(obj.get("prompt"), str):
                    prompts.append(obj["prompt"])
                else:
                    raise ValueError(f"{path}:{lineno}: no 'turns' list (or 'prompt' string)")
        super().__init__(prompts, output_len, seed=seed, count_tokens=count_tokens)


class CodeDataset(_TextDataset):
    """Prompts cut from the ``*.py`` files under `directory` (sorted, recursive).

    Each file is split into consecutive windows of whole lines holding about `input_len`
    tokens (counted with `count_tokens`, else estimated at CHARS_PER_TOKEN characters per
    token); windows shorter than a quarter of `input_len` (file tails) are dropped unless a
    file yields nothing else. The model is asked to continue the code.
    """

    def __init__(self, directory: str | os.PathLike, input_len: int, output_len: int, *,
                 seed: int = 0, count_tokens: TokenCounter | None = None) -> None:
        self.name = f"code:{directory}"
        root = Path(directory)
        if not root.is_dir():
            raise ValueError(f"code dataset directory {directory!r} does not exist")
        files = sorted(p for p in root.rglob("*.py") if p.is_file())
        if not files:
            raise ValueError(f"no *.py files under {directory!r}")
        prompts: list[str] = []
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            prompts.extend(self._windows(text, input_len, count_tokens))
        super().__init__(prompts, output_len, seed=seed, count_tokens=count_tokens)

    @staticmethod
    def _windows(text: str, input_len: int, count_tokens: TokenCounter | None) -> list[str]:
        windows, cur, cur_len = [], [], 0
        for line in text.splitlines(keepends=True):
            n = _estimate_tokens(line, count_tokens) if line.strip() else 1
            if cur and cur_len + n > input_len:
                windows.append("".join(cur))
                cur, cur_len = [], 0
            cur.append(line)
            cur_len += n
        if cur and (cur_len >= input_len / 4 or not windows):
            windows.append("".join(cur))
        return [w for w in windows if w.strip()]


def load_dataset(spec: str, *, input_len: int, output_len: int, range_ratio: float = 0.0,
                 seed: int = 0, vocab_size: int = 256,
                 count_tokens: TokenCounter | None = None) -> Dataset:
    """Resolve a ``--dataset`` value: ``random``, ``code:DIR`` or a path to a jsonl file."""
    if spec == "random":
        return RandomDataset(input_len, output_len, range_ratio, vocab_size=vocab_size, seed=seed)
    if spec.startswith("code:"):
        return CodeDataset(spec[len("code:"):], input_len, output_len, seed=seed,
                           count_tokens=count_tokens)
    if os.path.isfile(spec):
        return JsonlDataset(spec, output_len, seed=seed, count_tokens=count_tokens)
    raise ValueError(f"unknown dataset {spec!r}: use 'random', 'code:DIR' or a .jsonl file path")
