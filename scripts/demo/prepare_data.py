"""Step 1 of the demo pair (CPU): collect permissively licensed Python source, hold files out,
train the byte-level BPE tokenizer and tokenize the training files.

    python scripts/demo/prepare_data.py OUT_DIR [--max-mb 110]

Sources: the standard library of the running interpreter (PSF licence; test suites left out)
and installed packages whose metadata says MIT, BSD, Apache-2.0 or PSF (checked here, from the
package's own `License` / `License-Expression` / classifiers; anything else is skipped).
Held out: every file whose path hashes into the last 2% (`_held_out`), never seen by the
target, the tokenizer or the draft head; `heldout.jsonl` lists them with their text.

Writes OUT_DIR/tokenizer/ (tokenizer.json + config), OUT_DIR/train_tokens.npy.xz (uint16,
documents joined by </s>), OUT_DIR/heldout.jsonl and OUT_DIR/data.json (sources, licences,
file/byte/token counts), which `train_demo.py` reads on the device.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import lzma
import os
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np

VOCAB_SIZE = 8192
SPECIALS = ["<s>", "</s>", "<pad>"]
PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "0BSD", "ISC")
# Packages taken when their metadata is permissive (largest first; stops at --max-mb).
PACKAGES = ["numpy", "sympy", "networkx", "pip", "setuptools", "Pygments", "mpmath", "pydantic", "pytest",
            "rich", "huggingface_hub", "fsspec", "click", "Jinja2", "packaging", "anyio", "fastapi",
            "httpx", "idna", "python-dateutil", "pyparsing", "filelock", "typer", "h11", "httpcore",
            "starlette", "uvicorn", "pluggy", "iniconfig", "markdown-it-py", "prometheus_client", "certifi",
            "torch", "transformers"]
SKIP_DIRS = {"test", "tests", "testing", "__pycache__", "idle_test", "site-packages", "_vendor"}


def _held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def _licence(dist) -> str:
    m = dist.metadata
    text = (m.get("License-Expression") or "") + " " + (m.get("License") or "")[:200]
    text += " " + " ".join(c for c in (m.get_all("Classifier") or []) if c.startswith("License"))
    return " ".join(text.split())


def _is_permissive(lic: str) -> bool:
    up = lic.upper()
    return any(p in up for p in PERMISSIVE) and "GPL" not in up


def _py_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield Path(dirpath) / f


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if not 500 <= len(text) <= 300_000:
        return None
    lines = text.splitlines()
    if max(map(len, lines), default=0) > 400:  # generated tables, minified data
        return None
    return text


def collect(max_bytes: int) -> tuple[list[dict], list[dict]]:
    """[(source, rel, text)] for training and held out; plus the per-source records."""
    docs, sources = [], []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots = [("python-stdlib", f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
              "PSF-2.0", [stdlib])]
    for name in PACKAGES:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        lic = _licence(dist)
        if not _is_permissive(lic):
            print(f"skip {name}: licence {lic!r}", file=sys.stderr)
            continue
        tops = (dist.read_text("top_level.txt") or "").split() or [name.replace("-", "_").lower()]
        paths = [Path(dist.locate_file(t)) for t in tops if Path(dist.locate_file(t)).is_dir()]
        if not paths:
            mods = {str(f).split("/")[0] for f in (dist.files or []) if str(f).endswith(".py") and ".dist-info" not in str(f)}
            paths = [Path(dist.locate_file(m)) for m in sorted(mods) if Path(dist.locate_file(m)).is_dir()]
        roots.append((dist.metadata["Name"], dist.version, lic, paths))
    total = 0
    for name, version, lic, paths in roots:
        n = b = 0
        for root in paths:
            for p in _py_files(root):
                text = _read(p)
                if text is None:
                    continue
                rel = f"{name}/{p.relative_to(root.parent)}"
                docs.append({"source": name, "path": rel, "text": text, "held_out": _held_out(rel)})
                n += 1
                b += len(text.encode())
        sources.append({"name": name, "version": version, "licence": lic, "files": n, "bytes": b})
        total += b
        if total >= max_bytes:
            break
    return docs, sources


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=2048)
    fast.save_pretrained(str(out))
    return tok


def write_heldout_tokens(tok, held: list[dict], out: Path) -> None:
    """The held-out files as one token stream (documents joined by </s>), for the held-out loss."""
    eos = tok.token_to_id("</s>")
    ids = []
    for enc in tok.encode_batch([d["text"] for d in held]):
        ids.extend(enc.ids)
        ids.append(eos)
    with lzma.open(out / "heldout_tokens.npy.xz", "wb", preset=6) as f:
        np.save(f, np.asarray(ids, dtype=np.uint16))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-mb", type=float, default=110)
    ap.add_argument("--tokenizer-mb", type=float, default=40, help="training text sampled for the BPE")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    docs, sources = collect(int(a.max_mb * 1e6))
    train = [d for d in docs if not d["held_out"]]
    held = [d for d in docs if d["held_out"]]
    rng = random.Random(0)
    rng.shuffle(train)
    sample, size = [], 0
    for d in train:
        if size > a.tokenizer_mb * 1e6:
            break
        sample.append(d["text"])
        size += len(d["text"])
    tok = train_tokenizer(sample, out / "tokenizer")
    eos = tok.token_to_id("</s>")
    ids = []
    for s in range(0, len(train), 512):
        for enc in tok.encode_batch([d["text"] for d in train[s:s + 512]]):
            ids.extend(enc.ids)
            ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    with lzma.open(out / "train_tokens.npy.xz", "wb", preset=6) as f:
        np.save(f, arr)
    write_heldout_tokens(tok, held, out)
    with open(out / "heldout.jsonl", "w") as f:
        for d in held:
            f.write(json.dumps({"path": d["path"], "text": d["text"]}) + "\n")
    info = {"sources": sources, "train_files": len(train), "held_out_files": len(held),
            "train_bytes": sum(len(d["text"].encode()) for d in train), "train_tokens": int(arr.size),
            "vocab_size": tok.get_vocab_size(), "held_out_rule": "sha1(path) % 50 == 0",
            "held_out_paths": [d["path"] for d in held]}
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "held_out_paths"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
