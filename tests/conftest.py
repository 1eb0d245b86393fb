"""Shared fixtures: tiny random models (built once per session) and HF reference decoding."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which Triton selects when a
# kernel is decorated (module import): set it before any test module imports one.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores (torch would otherwise start one
# thread per core in every worker and the workers would fight over them); subprocesses that
# tests start (servers) inherit it through OMP_NUM_THREADS.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

from adaspec.testing import make_tiny_model

from helpers import ARCHS  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a: str(make_tiny_model(root / a, a)) for a in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def tok_model_dir(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer and a chat template."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tokmodel") / "m", "llama", tokenizer=True))


@pytest.fixture(scope="session")
def tok_head_dir(tok_model_dir, tmp_path_factory):
    """A random EAGLE-3 head for `tok_model_dir` (servers, the benchmark against them)."""
    from adaspec.testing import make_eagle3_head

    return str(make_eagle3_head(tmp_path_factory.mktemp("tokhead") / "h", tok_model_dir))


@pytest.fixture(scope="session")
def agree_dir(tmp_path_factory):
    """A tiny Llama with a small init: its greedy continuations settle into loops and
    repeats that a one-layer draft head can learn in seconds (the default init is chaotic)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("agree") / "target", "llama", init_std=0.05))


@pytest.fixture(scope="session")
def trained_head_result(agree_dir, tmp_path_factory):
    """An EAGLE-3 head trained for 300 steps on `agree_dir`'s own greedy continuations: it
    partly agrees with the target and relies on its KV cache. (head dir, training result)"""
    from adaspec.train import train_eagle3_head

    out = tmp_path_factory.mktemp("trained") / "head"
    # Hard labels: the tiny target's distributions are flat, and greedy acceptance needs its argmax.
    result = train_eagle3_head(agree_dir, out, steps=300, seed=0, loss="hard", num_threads=1)
    return out, result


@pytest.fixture(scope="session")
def trained_head(trained_head_result):
    return str(trained_head_result[0])
