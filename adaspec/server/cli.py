"""`adaspec serve` (the OpenAI-compatible server) and `adaspec generate` (one prompt from the shell).

serve: binds the port (a port in use fails at once), loads the engine, serves it with uvicorn,
logs ONE startup line (model, draft, policy, KV capacity, URL) once the socket listens.
SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
--shutdown-timeout seconds, abort the rest, and exit with status 0; a second signal ends every
request still in flight at once (streams still get their final chunk and [DONE]) and exits
128 + the signal.
A signal during start-up stops it (engine process included) and exits 128 + the signal. If the
engine dies while serving, in-flight requests fail, the cause is logged once and the exit is 1.

generate: streams the completion of one prompt to stdout; a summary line (token counts, speed,
and with a draft the acceptance length) goes to stderr so stdout stays the completion only.
Exit status: 0 success, 2 bad arguments or input, 1 the server could not start or failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time

from adaspec.engine import gc_heap
from adaspec.config import EngineConfig, add_engine_cli_args, engine_kwargs_from_cli
from adaspec.tokenization import TOKENIZER_FILES
from adaspec.server.serve_checks import check_paths, check_serve_values
from adaspec.server.vllm_flags import add_vllm_serve_flags, check_quantization_flag, vllm_settings

logger = logging.getLogger("adaspec.server")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _speculation_text(spec) -> str:
    """The policy and its largest draft, for the start-up line (`auto, chains of up to 8 drafts`)."""
    if spec.policy == "off" or spec.draft is None:
        return spec.policy
    return f"{spec.policy}, " + (f"chains of up to {spec.num_steps} drafts" if spec.topk == 1 else
                                 f"trees of {spec.num_steps} steps x {spec.topk} ({spec.resolved_num_draft_tokens} tokens)")


def _load_engine(args: argparse.Namespace, process: bool = False):
    """The engine for `args`; with `process`, in its own process (see server/engine_proc.py)."""
    from adaspec.demo import apply_demo_defaults
    from adaspec.engine.engine import Engine

    apply_demo_defaults(args)  # no --model: the bundled demo pair, speculation auto
    problem = check_paths(args)
    if problem is not None:
        raise ValueError(problem)
    cfg = EngineConfig.create(args.model, **engine_kwargs_from_cli(args))
    if process:
        from adaspec.server.engine_proc import EngineProcess
        return EngineProcess(cfg)
    return Engine(cfg)


# ----- serve ------------------------------------------------------------------------------------------
def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaspec serve", description="Run the OpenAI-compatible server.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model directory, as vLLM's `serve MODEL` (same as --model)")
    add_engine_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "glm45", "qwen3_coder"],
                   default=None,
                   help="how tool calls are read out of the model's text (default: the model family's)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged at startup)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests in flight (waiting + running) beyond which new ones get 503 + Retry-After")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one /v1/completions request may hold (more is a 400), so one client's "
                        "batch cannot fill the whole queue (capped at --max-queue-len)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header values the server answers, e.g. "
                        "'localhost,127.0.0.1,*.example.com' (others get 400, against DNS rebinding); "
                        "default: any")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins browsers may call the API from (CORS), e.g. "
                        "'https://app.example.com' or '*'; default: none (no CORS headers)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM")
    p.add_argument("--api-key", default=os.environ.get("ADASPEC_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $ADASPEC_API_KEY; "
                        "/health, /metrics and /server_info stay open)")
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies are refused with 413 (default 8 MiB)")
    p.add_argument("--client-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's head, and then its body, "
                        "before the connection is closed (408 for a body)")
    p.add_argument("--stall-timeout", type=float, default=5.0,
                   help="seconds without engine progress, with requests pending, after which "
                        "/health answers 503")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level of the server (default: info)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running/waiting, KV usage, speculation)")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats lines (default 10; an idle interval logs nothing)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--engine-in-thread", action="store_true",
                   help="run the engine in a thread of the server process instead of its own process "
                        "(simpler to debug; the HTTP work then competes with the engine for one GIL)")
    add_vllm_serve_flags(p)
    return p


class _Interrupted(Exception):
    """SIGINT or SIGTERM during start-up (before uvicorn takes the signals over)."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def _raise_interrupted(sig, frame) -> None:
    raise _Interrupted(sig)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so a port in use
    is reported at once; uvicorn listens on it once the engine is ready."""
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def serve_main(argv: list[str]) -> int:
    """Exit status: 0 after a graceful stop; 1 the port cannot be bound, or the engine died while
    serving; 2 bad arguments (a value, a path, or a configuration the engine refuses at load);
    128 + N when a signal N stopped the start-up, or a second signal N cut the drain short."""
    p = build_serve_parser()
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            logger.error("the model is given twice: %s (positional) and --model %s", args.model_tag, args.model)
            return 2
        args.model = args.model_tag
    problem = check_serve_values(args)
    if problem:
        logger.error("%s", problem)
        return 2
    try:
        from adaspec.demo import apply_demo_defaults
        apply_demo_defaults(args)
        cfg = EngineConfig.create(args.model, **engine_kwargs_from_cli(args))   # every value checked here
    except (ValueError, TypeError) as e:
        logger.error("%s", e)
        return 2
    problem = check_paths(args) or check_quantization_flag(args)
    if problem is not None:
        logger.error("%s", problem)
        return 2
    sched = cfg.scheduler
    if sched.max_num_batched_tokens < sched.max_num_seqs:
        logger.warning("--max-num-batched-tokens %d is below --max-num-seqs %d: a step cannot hold one token of "
                       "every running request, so some wait each step (and speculation has no room)",
                       sched.max_num_batched_tokens, sched.max_num_seqs)
    if args.tokenizer is None and not any(os.path.exists(os.path.join(args.model, f)) for f in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: only token-id prompts will work (pass --tokenizer DIR)", args.model)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, e.strerror or e)
        return 1
    # Until uvicorn takes the signals over, SIGINT / SIGTERM end the start-up: the engine
    # process (if started) is killed, and the exit is quiet and non-zero.
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine = None
    try:
        try:
            engine = _load_engine(args, process=not args.engine_in_thread)
        except (ValueError, TypeError, OSError, RuntimeError) as e:   # RuntimeError: the engine process died
            logger.error("cannot start the engine: %s", e)
            sock.close()
            return 2
        _warn_if_context_cut(args, engine)
        server = _build_server(args, engine, sock)
        # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with the
        # default handlers that would kill the process (status 143 for SIGTERM). These no-op
        # handlers are what it re-raises into; the exit status is decided below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    except _Interrupted as e:
        logger.error("start-up interrupted by %s; stopped", e)
        if engine is not None and hasattr(engine, "close"):
            engine.close(timeout=5)
        sock.close()
        return 128 + e.sig
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _raise_interrupted:
                signal.signal(sig, handler)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    if server.engine_death is not None:
        logger.error("adaspec server stopped because its engine died (exit status 1)")
        return 1
    if server.forced is not None:
        logger.warning("adaspec server stopped by a second %s", signal.Signals(server.forced).name)
        return 128 + server.forced
    logger.info("adaspec server stopped")
    return 0


def _warn_if_context_cut(args: argparse.Namespace, engine) -> None:
    """The engine silently fits the context to the KV cache when --max-model-len is not given;
    say so when that cuts it below what the model supports."""
    try:
        with open(os.path.join(args.model, "config.json")) as f:
            model_max = int(json.load(f).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        return
    if args.max_model_len is None and 0 < engine.max_model_len < model_max:
        logger.warning("the KV cache holds %d tokens, so the context is cut to %d tokens (the model "
                       "supports %d): give the cache more room (--num-kv-blocks, --kv-cache-memory, "
                       "--gpu-memory-utilization) or set --max-model-len", engine.max_model_len + 1,
                       engine.max_model_len, model_max)


def _comma_list(text: str | None) -> tuple[str, ...]:
    return tuple(h.strip() for h in (text or "").split(",") if h.strip())


def _build_server(args: argparse.Namespace, engine, sock: socket.socket):
    import uvicorn

    from adaspec.server.api import ServerSettings, create_app
    from adaspec.server.guard import GuardedH11Protocol

    settings = ServerSettings(served_model_name=args.served_model_name or args.model,
                              max_queue_len=args.max_queue_len, shutdown_timeout=args.shutdown_timeout,
                              api_key=args.api_key, max_body_bytes=args.max_request_bytes,
                              client_timeout_s=args.client_timeout, stall_timeout_s=args.stall_timeout,
                              max_prompts_per_request=args.max_prompts_per_request,
                              log_stats_interval_s=0.0 if args.disable_log_stats else args.log_stats_interval,
                              tool_call_parser=args.tool_call_parser,
                              allowed_hosts=_comma_list(args.allowed_hosts),
                              allowed_origins=_comma_list(args.allowed_origins), **vllm_settings(args))
    app = create_app(engine, settings)
    aengine = app.state.aengine
    cfg = engine.config
    block_size = cfg.cache.block_size

    class Server(uvicorn.Server):
        forced: int | None = None          # the second signal, if one cut the drain short
        engine_death: str | None = None    # why the engine died, if it did

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                # First signal: refuse new requests and, at the deadline, end the in-flight ones
                # with finish_reason "abort" so every client gets a complete response. uvicorn
                # meanwhile stops accepting connections and waits for the open ones to finish.
                logger.info("%s: draining %d in-flight request(s) for up to %g s (a second signal "
                            "stops at once)", signal.Signals(sig).name, aengine.num_inflight,
                            args.shutdown_timeout)
                aengine.drain(args.shutdown_timeout)
                super().handle_exit(sig, frame)
            elif self.forced is None and aengine.num_inflight:
                # Second signal while requests are in flight: end them now (each stream still
                # gets its final chunk and [DONE]), give the answers a moment to go out, then
                # cut what is left; the exit status says the drain was cut short. (With nothing
                # in flight the shutdown is already under way and goes on as it is.)
                # uvicorn's own force-exit is not used: it would skip the app's shutdown, and
                # with it the engine process's.
                self.forced = sig
                logger.warning("%s again: ending %d in-flight request(s) now", signal.Signals(sig).name,
                               aengine.num_inflight)
                aengine.abort_now()
                self._loop.call_soon_threadsafe(self._loop.call_later, 1.0, self._cut_connections)

        def _cut_connections(self) -> None:
            # Aborting the transport ends each request task on its own (its receive returns
            # http.disconnect); cancelling the tasks instead would log each as an ASGI error.
            for conn in list(self.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()

        def engine_died(self, cause: str) -> None:
            """The engine is gone (see AsyncEngine.on_dead): stop, so a supervisor restarts us."""
            self.engine_death = cause
            aengine.stopping = True
            self.should_exit = True
            # Every request has failed already; connections still open (idle keep-alives,
            # clients slow to send) would hold the exit for up to --client-timeout.
            self._loop.call_later(1.0, self._cut_connections)

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if not self.started:
                return
            gc_heap.freeze()   # the front end's start-up heap too (engine.gc_heap says why)
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else args.port
            st = aengine.stats
            total = int(st.get("num_total_blocks", 0) or 0)
            graphs = (f"{st['cuda_graphs']} CUDA graphs ({st['cuda_graph_capture_s']} s, "
                      f"{st['cuda_graph_memory_bytes'] / 2**30:.2f} GiB)" if st.get("cuda_graphs") else "eager")
            logger.info("adaspec serving %s | draft %s | speculation %s | device %s, dtype %s, TP %d%s | max "
                        "model len %d | KV capacity %d tokens (%d blocks x %d) | %s attention, %s | http://%s:%d",
                        settings.served_model_name, cfg.spec.draft or "none", _speculation_text(cfg.spec), cfg.device,
                        cfg.dtype, cfg.tensor_parallel_size, " (experts split: expert parallel)"
                        if cfg.enable_expert_parallel and cfg.tensor_parallel_size > 1 else "", engine.max_model_len, total * block_size, total,
                        block_size, st.get("attention_backend", "?"), graphs, args.host, port)

    # uvicorn's own start/stop chatter stays below the one startup line unless debugging.
    uv_level = "debug" if args.log_level == "debug" else "warning"
    # uvicorn's deadline, a few seconds after ours, is a backstop (a client that stopped reading).
    server = Server(uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level=uv_level,
                                   access_log=args.access_log, lifespan="on",
                                   http=GuardedH11Protocol.with_header_timeout(args.client_timeout),
                                   timeout_graceful_shutdown=args.shutdown_timeout + 5))
    aengine.on_dead = server.engine_died
    return server


# ----- generate ---------------------------------------------------------------------------------------
def build_generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaspec generate", description="Generate a completion for one prompt.")
    add_engine_cli_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-speculate", action="store_true", help="opt this request out of speculation")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def _draft_lengths(engine) -> dict:
    """{draft length: engine steps} of the run (one request, so its own; 0 = no draft, e.g.
    the prefill step, or steps `auto` or the threshold ran without speculation)."""
    try:
        return {int(k): int(v) for k, v in (engine.stats().get("draft_len_histogram") or {}).items()}
    except (AttributeError, TypeError, ValueError):
        return {}


def generate_main(argv: list[str]) -> int:
    from adaspec.sampling import SamplingParams
    from adaspec.tokenization import encode_chat, encode_text

    p = build_generate_parser()
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, stop=args.stop,
                                ignore_eos=args.ignore_eos, speculate=not args.no_speculate)
        prompt_ids = None
        if args.prompt_ids is not None:
            prompt_ids = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
    except ValueError as e:
        print(f"adaspec generate: error: {e}", file=sys.stderr)
        return 2
    try:
        engine = _load_engine(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"adaspec generate: error: cannot start the engine: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    try:
        if prompt_ids is None:
            if tok is None:
                raise ValueError("the model has no tokenizer; use --prompt-ids")
            prompt_ids = (encode_chat(tok, [{"role": "user", "content": args.prompt}]) if args.chat
                          else encode_text(tok, args.prompt))
        engine.add_request("generate-0", prompt_ids, params)
    except ValueError as e:
        print(f"adaspec generate: error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    first_token_s = None
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first_token_s is None:
                first_token_s = time.perf_counter() - start
            if out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    if final is None:
        print("adaspec generate: error: the engine finished without output", file=sys.stderr)
        return 1
    if final.text is None:  # no tokenizer: the completion is its token ids
        sys.stdout.write(" ".join(str(t) for t in final.token_ids))
    sys.stdout.write("\n")
    n = len(final.token_ids)
    summary = (f"[{len(final.prompt_token_ids)} prompt tokens, {n} generated, finish_reason={final.finish_reason}, "
               f"{elapsed:.2f}s, {n / elapsed if elapsed > 0 else 0.0:.1f} tok/s, "
               f"first token {first_token_s or 0.0:.3f}s]")
    if engine.config.spec.enabled:
        spec = final.spec or {}
        summary += (f"\n[speculation {engine.config.spec.policy}: acceptance length "
                    f"{float(spec.get('accept_length', 0.0)):.2f} over {spec.get('verify_steps', 0)} verify steps, "
                    f"{spec.get('accepted_tokens', 0)}/{spec.get('draft_tokens', 0)} draft tokens accepted; "
                    f"engine steps by draft length {_draft_lengths(engine)}]")
    print(summary, file=sys.stderr)
    return 0
