"""`adaspec bench` (sweep one running server) and the sweep options it shares with `adaspec
compare` (adaspec/bench/compare.py).

It returns a process exit code: 0 on success, 1 when the server is unreachable or no request
completed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from adaspec.bench.client import ApiTarget, BenchError, server_root
from adaspec.bench.datasets import Dataset, load_dataset
from adaspec.bench.report import plot_runs, simulated_banner, sweep_table, write_json
from adaspec.bench.sweep import Level, SweepConfig, run_sweep

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"


# ----------------------------------------------------------------------------- arguments

def _ints_at_least(text: str, low: int, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < low for v in vals):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return vals


def _int_list(text: str) -> list[int]:
    return _ints_at_least(text, 1, "positive integers")


def _counts(text: str) -> int | list[int]:
    """One positive integer, or a comma-separated list of them."""
    vals = _int_list(text)
    return vals[0] if len(vals) == 1 and "," not in text else vals


def _nonneg_int_list(text: str) -> list[int]:
    return _ints_at_least(text, 0, "integers >= 0")


def _rate_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (or inf), got {text!r}")
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive rates, got {text!r}")
    return vals


def add_bench_args(p: argparse.ArgumentParser, *, for_compare: bool = False) -> None:
    """The sweep options. `compare` shares --model/--tokenizer/--seed with the engine flags,
    so those (and --url) are only added for `bench`."""
    g = p.add_argument_group("benchmark")
    if not for_compare:
        g.add_argument("--url", default="http://127.0.0.1:8000",
                       help="server root, e.g. http://host:8000 (a trailing /v1, the SDK's "
                            "base_url, is dropped)")
        g.add_argument("--model", default=None,
                       help="model name to send (default: first id of GET /v1/models)")
        g.add_argument("--tokenizer", default=None,
                       help="tokenizer dir to count text-prompt tokens (default: estimate) "
                            "and to size random token ids")
        g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--concurrency", type=_int_list, default=None,
                   help=f"closed-loop levels, comma-separated (default {DEFAULT_CONCURRENCY})")
    g.add_argument("--request-rate", type=_rate_list, default=None,
                   help="open-loop Poisson arrival rates in req/s, comma-separated ('inf' = all "
                        "at once); replaces the concurrency levels")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: at most this many requests in flight")
    g.add_argument("--num-prompts", type=_counts, default=100,
                   help="requests per level: one number, or one per level (comma-separated)")
    g.add_argument("--prompt-starts", type=_nonneg_int_list, default=None,
                   help="dataset index of each level's first request, one per level (default: "
                        "the levels' requests one after another, after the warm-up's)")
    g.add_argument("--num-warmup", type=int, default=2, help="uncounted requests before the sweep")
    g.add_argument("--dataset", default="random",
                   help="'random', a Spec-Bench/MT-bench .jsonl path, or 'code:DIR'")
    g.add_argument("--input-len", type=int, default=128,
                   help="random: prompt tokens; code: tokens per prompt window")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len*(1-r) .. len*(1+r)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="random: token ids drawn below this (default: tokenizer/model vocab, else 256)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may stop early)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    g.add_argument("--no-metrics", dest="scrape_metrics", action="store_false",
                   help="do not scrape /metrics for acceptance figures")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    if not for_compare:
        g.add_argument("--label", default=None, help="name of this run in the table and plot")
        g.add_argument("--result-json", default=None, help="write the results to this JSON file")
        g.add_argument("--plot", default=None, help="write a PNG of throughput and latency")


def _levels(a: argparse.Namespace) -> tuple[Level, ...]:
    if a.request_rate is not None:
        if a.concurrency is not None:
            raise ValueError("give either --concurrency (closed loop) or --request-rate (open loop)")
        return tuple(Level(concurrency=a.max_concurrency, request_rate=r) for r in a.request_rate)
    if a.max_concurrency is not None:
        raise ValueError("--max-concurrency caps the open loop; use it with --request-rate")
    return tuple(Level(concurrency=c) for c in (a.concurrency or _int_list(DEFAULT_CONCURRENCY)))


def _load_tokenizer(path: str | None):
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - counting falls back to an estimate
        print(f"warning: cannot load tokenizer {path!r} ({type(e).__name__}: {e}); "
              "estimating prompt lengths", file=sys.stderr)
        return None


def _model_vocab(model_dir: str | None) -> int | None:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (TypeError, OSError, KeyError, ValueError):
        return None


def dataset_of(a: argparse.Namespace, tokenizer_path: str | None, model_dir: str | None) -> Dataset:
    needs_text_count = a.dataset != "random"
    tok = _load_tokenizer(tokenizer_path) if (needs_text_count or a.vocab_size is None) else None
    vocab = a.vocab_size or (len(tok) if tok is not None else None) or _model_vocab(model_dir) or 256
    count = (lambda s: len(tok.encode(s, add_special_tokens=False))) if tok is not None else None
    ds = load_dataset(a.dataset, input_len=a.input_len, output_len=a.output_len,
                      range_ratio=a.range_ratio, seed=a.seed, vocab_size=vocab, count_tokens=count)
    if a.endpoint == "chat" and a.dataset == "random":
        raise ValueError("the random dataset sends token ids, which /v1/chat/completions cannot "
                         "take; use --endpoint completions")
    return ds


def sweep_config(a: argparse.Namespace) -> SweepConfig:
    levels = _levels(a)
    counts = a.num_prompts
    if isinstance(counts, list) and len(counts) != len(levels):
        raise ValueError(f"--num-prompts: give one number or one per level ({len(levels)}), "
                         f"got {len(counts)}")
    return SweepConfig(levels=levels, num_prompts=tuple(counts) if isinstance(counts, list) else counts,
                       num_warmup=a.num_warmup, seed=a.seed, scrape_metrics=a.scrape_metrics,
                       progress=not a.disable_tqdm,
                       prompt_starts=tuple(a.prompt_starts) if a.prompt_starts else None)


def counts_text(counts: int | list[int]) -> str:
    return ",".join(map(str, counts)) if isinstance(counts, list) else str(counts)


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def completed(run: dict) -> int:
    return sum(lv["completed"] for lv in run.get("levels", []))


# ----------------------------------------------------------------------------- bench

def bench_main(argv: Sequence[str]) -> int:
    """`adaspec bench`: sweep a running OpenAI-compatible server (adaspec, vLLM, SGLang)."""
    p = argparse.ArgumentParser(prog="adaspec bench", description=bench_main.__doc__)
    add_bench_args(p)
    a = p.parse_args(list(argv))
    a.url = server_root(a.url)
    try:
        cfg = sweep_config(a)
        dataset = dataset_of(a, a.tokenizer, None)
    except ValueError as e:
        p.error(str(e))
    target = ApiTarget(base_url=a.url, model=a.model or "", endpoint=a.endpoint,
                       ignore_eos=a.ignore_eos, temperature=a.temperature, timeout_s=a.timeout)
    try:
        run = asyncio.run(run_sweep(target, dataset, cfg))
    except BenchError as e:
        print(f"adaspec bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("adaspec bench: interrupted", file=sys.stderr)
        return 130
    label = a.label or run["model"]
    result = {"tool": "adaspec bench", "command": "adaspec bench " + shlex.join(argv),
              "date": now_utc(), "config": dict(vars(a)), "url": a.url, "endpoint": a.endpoint,
              "dataset": dataset.name, "label": label, **run}
    if run["simulated_acceptance"] is not None:
        result["simulated_acceptance_note"] = simulated_banner(run["simulated_acceptance"])
    title = f"adaspec bench: {a.url}  model={run['model']}  dataset={dataset.name}"
    print(sweep_table(run, title))
    if a.result_json:
        print(f"results: {write_json(a.result_json, result)}")
    if a.plot:
        print(f"plot:    {plot_runs(a.plot, {label: run}, title, run['simulated_acceptance'])}")
    if completed(run) == 0:
        print("adaspec bench: error: no request completed; first errors: "
              + json.dumps(run["levels"][0]["errors"]), file=sys.stderr)
        return 1
    return 0
