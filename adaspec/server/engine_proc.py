"""The engine in its own process, behind the interface `AsyncEngine` drives.

Why: in one process the HTTP event loop (one SSE chunk per request per step: JSON, socket
writes) and the engine's step loop (scheduling, staging, postprocess) take turns on one GIL.
At a few hundred streams their CPU work adds up to more than a GPU step, and the GPU waits
(measured on the H200: 26 ms per token at 256 streams against a 13 ms step). Split, each has a
core: the engine process only plans and launches steps, the server process only talks HTTP.

Protocol (two one-way pipes, pickled tuples):
  server -> engine   ("add", id, prompt_ids, params) | ("abort", id) | ("stop",)
  engine -> server   ("ready", info) | ("startup_error", type, message) | ("fatal", message)
                     ("out", [delta, ...], stats, (num_stalled_steps, stalled_since))
                     (stats None: no new snapshot; one at most every STATS_EVERY_S while busy,
                     always once the engine is idle)
A delta is (id, new_token_ids, new_text, finished, finish_reason, error, num_cached_tokens,
spec, queue_time, new_logprobs, prompt_logprobs, stop_reason): only what changed (prompt logprobs in the
first and the last only), so a step's message stays small however long the outputs grow;
this side accumulates the full token ids and text.

Requests are validated HERE with the engine's own checks (`check_request`), so a bad request
fails at once with the same ValueError, without a round trip.

Liveness: the engine sends an "out" message after every step that produced something and at
least every 0.5 s while its loop turns (idle or busy); `last_heard` is when the last one
arrived, so a frozen engine process shows as silence (see AsyncEngine.stalled_for).
Death: once the process is gone, `alive` is False and `death_cause` says why; `step()` raises
`EngineProcessDied`, while `abort_request`, `stats` and `close` become quiet no-ops.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from adaspec.config import EngineConfig
from adaspec.engine.request import RequestOutput
from adaspec.sampling import SamplingParams
from adaspec.server.async_engine import STATS_EVERY_S
from adaspec.spec_decode.policy_trace import PolicyTrace

logger = logging.getLogger("adaspec.server")

_STARTUP_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "OSError": OSError,
                   "FileNotFoundError": FileNotFoundError}


class EngineProcessDied(RuntimeError):
    """The engine process exited unexpectedly."""


@dataclass
class _Live:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class EngineProcess:
    """An `Engine` running in a child process (spawned, so CUDA starts only there)."""

    def __init__(self, cfg: EngineConfig):
        from adaspec.tokenization import load_tokenizer

        self.config = cfg
        self._fatal: str | None = None           # what the engine said before it exited, if it could
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        # Daemonic unless it has tensor-parallel workers of its own (a daemonic process may not
        # start children); it dies with this process either way (`_die_with_parent`, `close`).
        self._proc = ctx.Process(target=_engine_main, args=(cfg, cmd_r, out_w), name="adaspec-engine",
                                 daemon=cfg.tensor_parallel_size == 1)
        # Started with SIGINT ignored (inherited through exec), so a Ctrl-C during start-up, which
        # the terminal sends to the whole process group, reaches only this process: it stops
        # the child itself (below) instead of the child dying mid-import with a traceback.
        previous = _ignore_sigint()
        try:
            self._proc.start()
        finally:
            _restore_sigint(previous)
        cmd_r.close()
        out_w.close()
        atexit.register(self._kill)
        try:
            # The tokenizer loads here while the child imports torch and loads the weights: the
            # two took 5.8 and 14 s one after the other for the demo pair on a 2-core CPU.
            # Its error, if any, is raised after the child's own (which says more).
            tokenizer_error = None
            try:
                self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, cfg.chat_template)
            except Exception as ex:  # noqa: BLE001 - re-raised below, once the child has spoken
                tokenizer_error = ex
            msg = self._recv()
        except BaseException:   # interrupted (a signal) or the child died while loading
            self._kill()
            raise
        if msg[0] == "startup_error":
            self._proc.join(10)
            raise _STARTUP_ERRORS.get(msg[1], RuntimeError)(msg[2])
        if tokenizer_error is not None:   # the engine has served nothing yet: nothing to drain
            self._kill()
            raise tokenizer_error
        info = msg[1]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.eos_token_ids = info.get("eos_token_ids", [])
        self.sampling_defaults = info["sampling_defaults"]
        self.draft_format = info["draft_format"]
        self._stats = info["stats"]
        self.last_heard = time.monotonic()
        self.death_cause: str | None = None
        self.num_stalled_steps, self.stalled_since = 0, None
        self._live: dict[str, _Live] = {}
        self._ready: deque[RequestOutput] = deque()
        self.alive = True

    # ---- the interface AsyncEngine uses ----------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> str:
        from adaspec.engine.engine import check_request

        ids, _ = check_request(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._live[request_id] = _Live(ids, text="" if self.tokenizer is not None and params.detokenize else None)
        self._send(("add", request_id, ids, params))
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None and self.alive:
            self._send(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._ready)

    def step(self, timeout: float = 0.05) -> list[RequestOutput]:
        """The outputs the engine sent since the last call (waits up to `timeout` for some)."""
        self._pump(timeout)
        outs = list(self._ready)
        self._ready.clear()
        return outs

    def stats(self) -> dict:
        if self.alive:
            self._pump(0.0)
        return self._stats

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine process (requests still in it are aborted there)."""
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except EngineProcessDied:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            logger.error("the engine process did not stop within %.0f s; killing it", timeout)
        self._kill()
        self.alive = False

    def _kill(self) -> None:
        """SIGKILL the engine process if it still runs (it ignores SIGTERM: see _engine_main)."""
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    # ---- plumbing --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            self._cmd.send(msg)
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def _recv(self):
        try:
            return self._out.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> EngineProcessDied:
        self._proc.join(5)
        self.alive = False
        code = self._proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        said = f": {self._fatal}" if self._fatal else ""
        self.death_cause = f"the engine process exited unexpectedly ({how}){said}"
        return EngineProcessDied(self.death_cause)

    def _pump(self, timeout: float) -> None:
        """Apply every message waiting from the engine (after up to `timeout` s for the first)."""
        try:
            waiting = self._out.poll(timeout)
        except (EOFError, OSError):
            waiting = True   # let _recv report it
        while waiting:
            msg = self._recv()
            self.last_heard = time.monotonic()
            if msg[0] == "fatal":
                self._fatal = msg[1]
            if msg[0] == "out":
                _, deltas, stats, (self.num_stalled_steps, self.stalled_since) = msg
                if stats is not None:   # (None: the engine skipped the snapshot, see STATS_EVERY_S)
                    self._stats = stats
                for d in deltas:
                    out = self._apply(d)
                    if out is not None:
                        self._ready.append(out)
            waiting = self._out.poll(0)

    def _apply(self, d) -> RequestOutput | None:
        rid, new_ids, new_text, finished, reason, error, cached, spec, queued, new_lps, prompt_lps, stop_reason = d
        live = self._live.get(rid)
        if live is None:          # aborted here meanwhile
            return None
        live.token_ids.extend(new_ids)
        if new_lps is not None:
            if live.logprobs is None:
                live.logprobs = []
            live.logprobs.extend(new_lps)
        if prompt_lps is not None:
            live.prompt_logprobs = prompt_lps
        if new_text is not None and live.text is not None:
            live.text += new_text
        if finished:
            del self._live[rid]
        # Outputs of a running request share its growing token list (consumers read
        # new_token_ids); a finished request's output owns its list.
        return RequestOutput(request_id=rid, prompt_token_ids=live.prompt_token_ids,
                             token_ids=list(live.token_ids) if finished else live.token_ids,
                             text=live.text, new_token_ids=new_ids, new_text=new_text, finished=finished,
                             finish_reason=reason, spec=spec, num_cached_tokens=cached, error=error,
                             queue_time=queued, new_logprobs=new_lps, prompt_logprobs=live.prompt_logprobs,
                             logprobs=list(live.logprobs) if finished and live.logprobs is not None else live.logprobs,
                             stop_reason=stop_reason)


def _ignore_sigint():
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


def _restore_sigint(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the server process dies, however it
    dies (even SIGKILL, where no cleanup of the server runs), so no engine is left holding
    GPU memory as an orphan. (The kernel ties this to the THREAD that started the process:
    create the EngineProcess on a thread that lives as long as it, as the server does.)"""
    parent = mp.parent_process().pid if mp.parent_process() is not None else os.getppid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):   # not Linux: close() and atexit still stop it
        return
    if os.getppid() != parent:           # the parent died before prctl took effect
        os._exit(1)


def _delta(o: RequestOutput) -> tuple:
    return (o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.error, o.num_cached_tokens,
            o.spec, o.queue_time, o.new_logprobs, o.prompt_logprobs, o.stop_reason)


def _engine_main(cfg: EngineConfig, cmd, out) -> None:
    """The engine process: apply commands between steps, step while anything is unfinished,
    send each step's output deltas with a stats snapshot."""
    # Signals go to the server, which shuts this process down in order ("stop").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from adaspec.engine.engine import Engine

    try:
        engine = Engine(cfg)
        engine.delta_outputs = True   # only the deltas travel (`_delta`)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with it
        out.send(("startup_error", type(e).__name__, str(e)))
        return
    try:
        out.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                            "eos_token_ids": engine.eos_token_ids,
                            "sampling_defaults": dict(engine.sampling_defaults),
                            "draft_format": engine.draft_format,
                            "stats": engine.stats()}))
    except (BrokenPipeError, OSError):   # the server gave up while we loaded
        return
    last_sent = last_stats = time.monotonic()
    profiler = _start_profile()
    trace = PolicyTrace(engine.policy) if os.environ.get("ADASPEC_POLICY_TRACE") else None
    while True:
        # Idle (or stalled: it planned nothing last step) -> wait for a command, up to 0.5 s.
        busy = engine.has_unfinished() and not engine.num_stalled_steps
        try:
            if not busy:
                cmd.poll(0.5)
            failed: list[tuple] = []
            applied = False
            while cmd.poll():
                c = cmd.recv()
                applied = True
                if c[0] == "add":
                    try:
                        engine.add_request(c[1], c[2], c[3])
                    except Exception as e:  # noqa: BLE001 - checked on the server side already
                        failed.append((c[1], [], None, True, "abort", f"the engine refused the request: {e}",
                                       0, {}, None, None, None))
                elif c[0] == "abort":
                    engine.abort_request(c[1])
                elif c[0] == "stop":
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                    _log_final_stats(engine)
                    if profiler is not None:
                        _dump_profile(profiler)
                    if trace is not None:   # (spec_decode/policy_trace.py: what the policy saw)
                        trace.write(f"{os.environ['ADASPEC_POLICY_TRACE']}.{os.getpid()}.jsonl")
                    engine.close()   # its tensor-parallel workers, if any
                    return
        except (EOFError, OSError):   # the server is gone
            return
        try:
            outs = engine.step() if engine.has_unfinished() else []
        except Exception as e:
            if engine.alive:
                raise
            try:   # the engine cannot continue (a tensor-parallel worker died): say why, then exit
                out.send(("fatal", str(e)))
            except (BrokenPipeError, OSError):
                pass
            logging.getLogger("adaspec").error("engine stopped: %s", e)
            engine.close()
            raise SystemExit(1) from None
        now = time.monotonic()
        if outs or failed or applied or now - last_sent > 0.5:
            # A fresh stats snapshot at most every STATS_EVERY_S while busy, always once idle:
            # building and sending one is host time of every step (~0.1 ms with auto's state).
            fresh = now - last_stats >= STATS_EVERY_S or not engine.has_unfinished()
            if fresh:
                last_stats = now
            try:
                out.send(("out", failed + [_delta(o) for o in outs], engine.stats() if fresh else None,
                          (engine.num_stalled_steps, engine.stalled_since)))
            except (BrokenPipeError, OSError):
                return
            last_sent = now


def _log_final_stats(engine) -> None:
    """One INFO line at shutdown: what the steps were (speculating or not, draft lengths, how
    their parts ran: CUDA graphs or eager) and where the policy ended, for reading a run back."""
    st = engine.stats()
    keys = ("num_steps", "spec_steps", "nonspec_steps", "draft_len_histogram", "accept_length", "launches",
            "host_ms_per_step", "policy_state")
    logging.getLogger("adaspec").info("engine stats at shutdown: %s", {k: st.get(k) for k in keys})


def _start_profile():
    """ADASPEC_ENGINE_PROFILE=PREFIX: profile the engine process's loop with cProfile, written
    to PREFIX.<pid>.prof at a clean stop (for reading where a served step's host time goes)."""
    if not os.environ.get("ADASPEC_ENGINE_PROFILE"):
        return None
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _dump_profile(profiler) -> None:
    profiler.disable()
    path = f"{os.environ['ADASPEC_ENGINE_PROFILE']}.{os.getpid()}.prof"
    profiler.dump_stats(path)
    logging.getLogger("adaspec").info("engine loop profile written to %s", path)
