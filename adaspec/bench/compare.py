"""`adaspec compare`: start the adaspec server once per speculation configuration, sweep each
with the same requests, compare. Returns a process exit code: 0 on success, 1 when a server fails
to start or no request completed, 2 for bad arguments, 130 when interrupted (^C or SIGTERM)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence

from adaspec.bench.cli import add_bench_args, completed, counts_text, dataset_of, now_utc, sweep_config
from adaspec.bench.client import ApiTarget, BenchError
from adaspec.bench.configs import ServerConfig, check_flags, parse_configs, raising
from adaspec.bench.report import (compare_rows, compare_table, plot_runs, rounds_summary, rounds_table,
                                  simulated_banner, sweep_table, write_json)
from adaspec.bench.server import ServerProcess, free_port
from adaspec.bench.sweep import run_sweep


def _passthrough_dests() -> tuple[str, ...]:
    """`add_engine_cli_args` destinations that `compare` forwards to every server unchanged:
    all engine options but those a configuration decides (draft, policy, threshold)."""
    from adaspec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from adaspec.options import dest_of, option_fields

    own = {"draft", "speculation", "spec_disable_batch_size"}
    return tuple(dest_of(m) for k in (EngineConfig, CacheConfig, SchedulerConfig, SpecConfig)
                 for _, m in option_fields(k) if m["flag"] and dest_of(m) not in own)


PASSTHROUGH_ENGINE_FLAGS = _passthrough_dests()


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
        cfg = sweep_config(a)
        dataset = dataset_of(a, a.tokenizer or a.model, a.model)
    except ValueError as e:
        p.error(str(e))

    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = {ns.spec_simulate_accept_rate for c, _, ns in planned if c.policy != "off"}
    simulated = a.spec_simulate_accept_rate
    if simulated is None and len(rates) == 1:
        simulated = next(iter(rates))
    title = (f"adaspec compare: model={a.model} draft={a.draft} dataset={dataset.name} "
             f"in={a.input_len} out={a.output_len} prompts/level={counts_text(a.num_prompts)}")
    rounds: list[dict[str, dict]] = []
    failures = 0
    interrupted = False

    def save(**extra) -> Path:
        """compare.json of the first round as it stands. Rewritten after every level, so a
        run killed mid-way (a device call's time limit) leaves its finished levels to merge."""
        runs = rounds[0]
        return write_json(out_dir / "compare.json", {
            "tool": "adaspec compare", "command": "adaspec compare " + shlex.join(argv),
            "date": now_utc(), "config": dict(vars(a)), "dataset": dataset.name,
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
            if completed(entry) == 0:
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
