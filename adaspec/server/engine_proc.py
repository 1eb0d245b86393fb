"""The engine in its own process, behind the interface `AsyncEngine` drives.

Why: in one process the HTTP event loop (one SSE chunk per request per step: JSON, socket
writes) and the engine's step loop (scheduling, staging, postprocess) take turns on one GIL.
At a few hundred streams their CPU work adds up to more than a GPU step, and the GPU waits
(measured on the H200: 26 ms per token at 256 streams against a 13 ms step). Split, each has a
core: the engine process only plans and launches steps, the server process only talks HTTP.

Protocol (two one-way pipes, pickled tuples):
  server -> engine   ("add", id, prompt_ids, params) | ("abort", id) | ("stop",)
  engine -> server   ("ready", info) | ("startup_error", type, message)
                     ("out", [delta, ...], stats, (num_stalled_steps, stalled_since))
A delta is (id, new_token_ids, new_text, finished, finish_reason, error, num_cached_tokens,
spec): only what changed, so a step's message stays small however long the outputs grow;
this side accumulates the full token ids and text.

Requests are validated HERE with the engine's own checks (`check_request`), so a bad request
fails at once with the same ValueError, without a round trip.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass, field

from adaspec.config import EngineConfig
from adaspec.engine.request import RequestOutput
from adaspec.sampling import SamplingParams

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


class EngineProcess:
    """An `Engine` running in a child process (spawned, so CUDA starts only there)."""

    def __init__(self, cfg: EngineConfig):
        from adaspec.tokenization import load_tokenizer

        self.config = cfg
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_engine_main, args=(cfg, cmd_r, out_w), name="adaspec-engine",
                                 daemon=True)
        self._proc.start()
        cmd_r.close()
        out_w.close()
        msg = self._recv()
        if msg[0] == "startup_error":
            self._proc.join(10)
            raise _STARTUP_ERRORS.get(msg[1], RuntimeError)(msg[2])
        info = msg[1]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.sampling_defaults = info["sampling_defaults"]
        self.draft_format = info["draft_format"]
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self._stats = info["stats"]
        self.num_stalled_steps, self.stalled_since = 0, None
        self._live: dict[str, _Live] = {}
        self._ready: deque[RequestOutput] = deque()
        self.alive = True

    # ---- the interface AsyncEngine uses ----------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> str:
        from adaspec.engine.engine import check_request

        ids = check_request(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._live[request_id] = _Live(ids, text="" if self.tokenizer is not None else None)
        self._send(("add", request_id, ids, params))
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
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
            logger.error("the engine process did not stop within %.0f s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(5)
        self.alive = False

    # ---- plumbing --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            self._cmd.send(msg)
        except (BrokenPipeError, OSError):
            self.alive = False
            raise EngineProcessDied(f"the engine process is gone (exit code {self._proc.exitcode})") from None

    def _recv(self):
        try:
            return self._out.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            self.alive = False
            raise EngineProcessDied(f"the engine process exited (exit code {self._proc.exitcode})") from None

    def _pump(self, timeout: float) -> None:
        """Apply every message waiting from the engine (after up to `timeout` s for the first)."""
        try:
            waiting = self._out.poll(timeout)
        except (EOFError, OSError):
            waiting = True   # let _recv report it
        while waiting:
            msg = self._recv()
            if msg[0] == "out":
                _, deltas, self._stats, (self.num_stalled_steps, self.stalled_since) = msg
                for d in deltas:
                    out = self._apply(d)
                    if out is not None:
                        self._ready.append(out)
            waiting = self._out.poll(0)

    def _apply(self, d) -> RequestOutput | None:
        rid, new_ids, new_text, finished, reason, error, cached, spec = d
        live = self._live.get(rid)
        if live is None:          # aborted here meanwhile
            return None
        live.token_ids.extend(new_ids)
        if new_text is not None and live.text is not None:
            live.text += new_text
        if finished:
            del self._live[rid]
        # Outputs of a running request share its growing token list (consumers read
        # new_token_ids); a finished request's output owns its list.
        return RequestOutput(request_id=rid, prompt_token_ids=live.prompt_token_ids,
                             token_ids=list(live.token_ids) if finished else live.token_ids,
                             text=live.text, new_token_ids=new_ids, new_text=new_text, finished=finished,
                             finish_reason=reason, spec=spec, num_cached_tokens=cached, error=error)


def _delta(o: RequestOutput) -> tuple:
    return (o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.error, o.num_cached_tokens,
            o.spec)


def _engine_main(cfg: EngineConfig, cmd, out) -> None:
    """The engine process: apply commands between steps, step while anything is unfinished,
    send each step's output deltas with a stats snapshot."""
    # Signals go to the server, which shuts this process down in order ("stop").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from adaspec.engine.engine import Engine

    try:
        engine = Engine(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with it
        out.send(("startup_error", type(e).__name__, str(e)))
        return
    draft = getattr(engine.runner, "draft", None)
    out.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                        "sampling_defaults": dict(engine.sampling_defaults),
                        "draft_format": draft.fmt.layout if draft is not None else None,
                        "stats": engine.stats()}))
    last_sent = time.monotonic()
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
                                       0, {}))
                elif c[0] == "abort":
                    engine.abort_request(c[1])
                elif c[0] == "stop":
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                    return
        except (EOFError, OSError):   # the server is gone
            return
        outs = engine.step() if engine.has_unfinished() else []
        now = time.monotonic()
        if outs or failed or applied or now - last_sent > 0.5:
            try:
                out.send(("out", failed + [_delta(o) for o in outs], engine.stats(),
                          (engine.num_stalled_steps, engine.stalled_since)))
            except (BrokenPipeError, OSError):
                return
            last_sent = now
