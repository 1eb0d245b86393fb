"""`adaspec bench` (sweep one running server) and `adaspec compare` (start the server once
per speculation configuration, sweep each with the same requests, compare).

Both return a process exit code: 0 on success, 1 when the server is unreachable, a server
fails to start, or no request completed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence

from adaspec.bench.client import ApiTarget, BenchError, server_root
from adaspec.bench.configs import ServerConfig, check_flags, parse_configs, parse_policy, raising
from adaspec.bench.datasets import Dataset, load_dataset
from adaspec.bench.report import (compare_rows, compare_table, plot_runs, rounds_summary, rounds_table,
                                  simulated_banner, sweep_table, write_json)
from adaspec.bench.server import ServerProcess, free_port
from adaspec.bench.sweep import Level, SweepConfig, run_sweep

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"

def _passthrough_dests() -> tuple[str, ...]:
    """`add_engine_cli_args` destinations that `compare` forwards to every server unchanged:
    all engine options but those a configuration decides (draft, policy, threshold)."""
    from adaspec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from adaspec.options import dest_of, option_fields

    own = {"draft", "speculation", "spec_disable_batch_size"}
    return tuple(dest_of(m) for k in (EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
                 for _, m in option_fields(k) if m["flag"] and dest_of(m) not in own)


PASSTHROUGH_ENGINE_FLAGS = _passthrough_dests()


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


def _dataset(a: argparse.Namespace, tokenizer_path: str | None, model_dir: str | None) -> Dataset:
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


def _sweep_config(a: argparse.Namespace) -> SweepConfig:
    levels = _levels(a)
    counts = a.num_prompts
    if isinstance(counts, list) and len(counts) != len(levels):
        raise ValueError(f"--num-prompts: give one number or one per level ({len(levels)}), "
                         f"got {len(counts)}")
    return SweepConfig(levels=levels, num_prompts=tuple(counts) if isinstance(counts, list) else counts,
                       num_warmup=a.num_warmup, seed=a.seed, scrape_metrics=a.scrape_metrics,
                       progress=not a.disable_tqdm,
                       prompt_starts=tuple(a.prompt_starts) if a.prompt_starts else None)


def _text(counts: int | list[int]) -> str:
    return ",".join(map(str, counts)) if isinstance(counts, list) else str(counts)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _completed(run: dict) -> int:
    return sum(lv["completed"] for lv in run.get("levels", []))


# ----------------------------------------------------------------------------- bench

def bench_main(argv: Sequence[str]) -> int:
    """`adaspec bench`: sweep a running OpenAI-compatible server (adaspec, vLLM, SGLang)."""
    p = argparse.ArgumentParser(prog="adaspec bench", description=bench_main.__doc__)
    add_bench_args(p)
    a = p.parse_args(list(argv))
    a.url = server_root(a.url)
    try:
        cfg = _sweep_config(a)
        dataset = _dataset(a, a.tokenizer, None)
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
              "date": _now(), "config": dict(vars(a)), "url": a.url, "endpoint": a.endpoint,
              "dataset": dataset.name, "label": label, **run}
    if run["simulated_acceptance"] is not None:
        result["simulated_acceptance_note"] = simulated_banner(run["simulated_acceptance"])
    title = f"adaspec bench: {a.url}  model={run['model']}  dataset={dataset.name}"
    print(sweep_table(run, title))
    if a.result_json:
        print(f"results: {write_json(a.result_json, result)}")
    if a.plot:
        print(f"plot:    {plot_runs(a.plot, {label: run}, title, run['simulated_acceptance'])}")
    if _completed(run) == 0:
        print("adaspec bench: error: no request completed; first errors: "
              + json.dumps(run["levels"][0]["errors"]), file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- compare

def parse_config(text: str) -> tuple[str, int | None]:
    """'off' | 'always' | 'auto' | 'threshold:N' -> (policy, spec_disable_batch_size)."""
    return parse_policy(text)


def passthrough_flags(p: argparse.ArgumentParser, a: argparse.Namespace,
                      skip: Sequence[str] = ()) -> list[str]:
    """The engine flags given with a non-default value, as command-line words (`skip`: the
    destinations a configuration sets itself)."""
    words: list[str] = []
    for dest in PASSTHROUGH_ENGINE_FLAGS:
        value = getattr(a, dest)
        if dest in skip or value == p.get_default(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    return words


def server_command(a: argparse.Namespace, policy: str, disable_bs: int | None, port: int,
                   extra: Sequence[str], *, with_draft: bool = True) -> list[str]:
    """`python -m adaspec.cli serve ...` for one configuration ('off' runs without the draft;
    `with_draft=False`: `extra` names the draft itself)."""
    cmd = [sys.executable, "-m", "adaspec.cli", "serve", "--model", a.model]
    if policy != "off" and with_draft:
        cmd += ["--draft", a.draft]
    cmd += ["--speculation", policy]
    if disable_bs is not None:
        cmd += ["--spec-disable-batch-size", str(disable_bs)]
    return cmd + ["--host", "127.0.0.1", "--port", str(port), *extra]


def config_server_command(p: argparse.ArgumentParser, a: argparse.Namespace, cfg: ServerConfig,
                          port: int) -> tuple[list[str], argparse.Namespace]:
    """The server command of one configuration: the global engine flags, minus those the
    configuration sets, then its own flags. Parsed with the server's parser and turned into
    an `EngineConfig` (nothing loaded), so a bad flag or an impossible draft shape fails here,
    before any server starts. Returns (command, the server's parsed arguments); raises
    ValueError naming the configuration."""
    from adaspec.config import EngineConfig, engine_kwargs_from_cli
    from adaspec.server.cli import build_serve_parser

    given = check_flags(cfg, build_serve_parser())
    extra = passthrough_flags(p, a, skip=given) + list(cfg.flags)
    if cfg.policy != "off" and a.draft is None and given.get("draft") is None:
        raise ValueError(f"configuration {cfg.label!r} ({cfg.policy_text}) needs --draft")
    cmd = server_command(a, cfg.policy, cfg.disable_bs, port, extra, with_draft="draft" not in given)
    try:
        ns = raising(build_serve_parser()).parse_args(cmd[4:])
        EngineConfig.create(ns.model, **engine_kwargs_from_cli(ns))
    except (ValueError, TypeError) as e:
        raise ValueError(f"configuration {cfg.label!r}: {e}") from None
    return cmd, ns


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt inside the block (main thread only; elsewhere a no-op)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def compare_main(argv: Sequence[str]) -> int:
    """`adaspec compare`: start the adaspec server once per speculation configuration, sweep
    each with the same requests and seeds, and compare output throughput level by level.
    --seed seeds both the engine and the prompts; --tokenizer (default: the model dir) also
    counts text-prompt tokens. A configuration whose server fails to start is recorded with
    its error and the others still run (exit status 1)."""
    from adaspec.config import add_engine_cli_args

    p = argparse.ArgumentParser(prog="adaspec compare", description=compare_main.__doc__)
    add_engine_cli_args(p)
    p.add_argument("--configs", default="off,always",
                   help="a JSON list (or .json file) of {\"label\", \"policy\", \"flags\": [...], \"request\": {...}}, "
                        "or the short form: comma-separated [LABEL=]POLICY[FLAGS], POLICY one of off, always, auto, "
                        "threshold:N (speculate while at most N requests run), FLAGS `adaspec serve` "
                        "flags in brackets that override the shared ones (and --request-json JSON: "
                        "fields added to every request of that configuration), e.g. "
                        "'off,chain3=always[--num-steps 3 --topk 1],thr32=threshold:32' "
                        "(see adaspec/bench/configs.py)")
    p.add_argument("--out-dir", required=True, help="compare.json, compare.png and server logs")
    p.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for each server's /health")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, the configurations interleaved (a fresh "
                        "server each), and add the median tok/s and each round's ratio to the first "
                        "configuration (a host whose speed moves from one process to the next)")
    add_bench_args(p, for_compare=True)
    a = p.parse_args(list(argv))
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    from adaspec.demo import apply_demo_defaults
    try:
        apply_demo_defaults(a, set_policy=False)  # no --model: the bundled demo pair
    except ValueError as e:
        p.error(str(e))
    if a.speculation is not None or a.spec_disable_batch_size is not None:
        p.error("--speculation/--spec-disable-batch-size are set per configuration: use --configs")
    try:
        configs = parse_configs(a.configs)
        # Every server command is built and checked before the first server starts.
        planned = [(c, *config_server_command(p, a, c, 0)) for c in configs]
        cfg = _sweep_config(a)
        dataset = _dataset(a, a.tokenizer or a.model, a.model)
    except ValueError as e:
        p.error(str(e))

    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = {ns.spec_simulate_accept_rate for c, _, ns in planned if c.policy != "off"}
    simulated = a.spec_simulate_accept_rate
    if simulated is None and len(rates) == 1:
        simulated = next(iter(rates))
    title = (f"adaspec compare: model={a.model} draft={a.draft} dataset={dataset.name} "
             f"in={a.input_len} out={a.output_len} prompts/level={_text(a.num_prompts)}")
    rounds: list[dict[str, dict]] = []
    failures = 0
    interrupted = False

    def save(**extra) -> Path:
        """compare.json of the first round as it stands. Rewritten after every level, so a
        run killed mid-way (a device call's time limit) leaves its finished levels to merge."""
        runs = rounds[0]
        return write_json(out_dir / "compare.json", {
            "tool": "adaspec compare", "command": "adaspec compare " + shlex.join(argv),
            "date": _now(), "config": dict(vars(a)), "dataset": dataset.name,
            "simulated_acceptance": simulated, "simulated_acceptance_note": simulated_banner(simulated) or None,
            "configs": runs, "comparison": compare_rows(runs), **extra})

    # A device call's time limit ends a run with SIGTERM: taken as an interrupt, so the server
    # is stopped and what finished is written, as on ^C.
    with _sigterm_interrupts():
        for rnd, (c, _, ns) in [(r, x) for r in range(a.rounds) for x in planned]:
            if len(rounds) <= rnd:
                rounds.append({})
            runs = rounds[rnd]
            label = c.label
            port = free_port()
            cmd, _ = config_server_command(p, a, c, port)
            safe = label.replace(":", "-") + (f"-round{rnd + 1}" if a.rounds > 1 else "")
            entry: dict = {"policy": c.policy, "spec_disable_batch_size": c.disable_bs,
                           "flags": list(c.flags), "request_json": c.request_fields or None,
                           "config": c.to_text(), "server_command": cmd,
                           "server_log": str(out_dir / f"server-{safe}.log"), "levels": [],
                           "error": "unfinished: the run stopped before this configuration's last level"}
            runs[label] = entry

            def on_level(lv: dict, entry=entry, first_round=rnd == 0) -> None:
                entry["levels"].append(lv)
                if first_round:
                    save()

            print(f"== {label}: starting {shlex.join(cmd)}", file=sys.stderr)
            server = ServerProcess(cmd, f"http://127.0.0.1:{port}", entry["server_log"],
                                   startup_timeout=a.server_timeout)
            try:
                with server:
                    entry["startup_s"] = server.startup_s
                    target = ApiTarget(base_url=server.base_url, model="", endpoint=a.endpoint,
                                       ignore_eos=a.ignore_eos, temperature=a.temperature,
                                       timeout_s=a.timeout,
                                       extra_body=tuple(c.request_fields.items()))
                    entry.update(asyncio.run(run_sweep(target, dataset, cfg, on_level=on_level)), error=None)
            except BenchError as e:
                entry["error"] = str(e)
                failures += 1
                print(f"adaspec compare: {label}: error: {e}", file=sys.stderr)
                continue
            except KeyboardInterrupt:
                entry["error"] = "interrupted"
                interrupted = True
                print(f"adaspec compare: interrupted during {label}; writing what is done",
                      file=sys.stderr)
                break
            rate = ns.spec_simulate_accept_rate
            if entry.get("simulated_acceptance") is None and rate is not None and c.policy != "off":
                entry["simulated_acceptance"] = rate
            print(sweep_table(entry, f"-- {label}"))
            if _completed(entry) == 0:
                failures += 1

    runs = rounds[0]
    rows = compare_rows(runs)
    names = [c.label for c in configs]
    print()
    print(compare_table(rows, names, title, simulated))
    extra = {}
    if a.rounds > 1:   # (the table above and "configs": the first round)
        summary = rounds_summary(rounds, names)
        print(f"\nover {len(rounds)} rounds:\n" + rounds_table(summary, names))
        extra = {"rounds": rounds, "rounds_summary": summary}
    print(f"results: {save(**extra)}")
    print(f"plot:    {plot_runs(out_dir / 'compare.png', runs, title, simulated)}")
    if interrupted:
        return 130
    return 1 if failures else 0
