"""Run the synchronous `Engine` in a background thread and expose it to asyncio.

Threading contract (the engine is not thread-safe, so exactly one thread ever touches it):
  * The engine thread owns the engine. It applies queued commands (add / abort / stop) only
    between steps, then calls `step()` while anything is unfinished, and sleeps on the command
    queue when idle.
  * The event-loop thread owns `_streams` (request id -> RequestStream). The engine thread hands
    each step's outputs to the loop with ONE `call_soon_threadsafe`, so streams never see a
    half-dispatched step and the loop is never blocked by engine work.
  * `stats` is a snapshot of `engine.stats()` taken by the engine thread after a step (at most
    every STATS_EVERY_S while busy, always once idle) and every batch of commands; readers
    (metrics, /server_info) never call into the engine.

Request life: `submit` registers the stream and queues the add synchronously (so the overload
check in the API counts it at once); `accepted` waits for the engine to take it; `abort` (client
gone) drops the stream and frees the request's KV before the next step; `drain` + `stop` shut down.

Failure contract:
  * `accepted` raises the engine's ValueError (bad input) to the caller; nothing else happens.
  * An output carrying `error`, or an exception while adding, fails only that request: its
    stream raises `EngineError` and the error is logged.
  * If `step()` raises, every in-flight request is aborted and failed with `EngineError`, the
    traceback is logged, and the loop keeps serving new requests.
  * If the engine is gone (an engine process whose `alive` turned False: killed, crashed), the
    cause is logged ONCE, every in-flight request fails with `EngineError`, the thread ends and
    `on_dead(cause)` (when set) is called on the event loop: the server exits non-zero then,
    so a supervisor restarts it, instead of staying up answering 503.

Liveness (`stalled_for`, behind /health): with requests in flight, the engine is stalled when
it has planned nothing for `stall_timeout_s` (its own watch, `stalled_since`) OR when nothing
was heard from it for that long: the engine thread's last turn, and for an engine process the
last message it sent (it sends at least every 0.5 s while its loop turns, busy or idle). A
frozen engine (SIGSTOP, a deadlock, a kernel that never returns) sends nothing and is caught
by the second clause; the first alone could not see it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any

from adaspec.engine.request import RequestOutput
from adaspec.sampling import SamplingParams
from adaspec.server.request_stream import EngineError, RequestStream

STATS_EVERY_S = 0.05   # how stale the stats snapshot may be while the engine is busy

logger = logging.getLogger("adaspec.server")


class AsyncEngine:
    """Asyncio front of a synchronous engine (see the module docstring for the contract).

    `metrics` (optional) receives `on_output(stream, output, now)` for every dispatched output
    and `on_abort(stream)` for client aborts; it is called on the event loop.
    """

    def __init__(self, engine: Any, *, metrics: Any = None, idle_poll_s: float = 0.5,
                 stall_timeout_s: float = 5.0):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._in_engine: set[str] = set()       # engine-thread view of unfinished requests
        self._stats: dict = self._safe_stats()
        self._stats_at = time.monotonic()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._beat = time.monotonic()            # the engine thread's last loop turn
        self.stopping = False
        self.dead: str | None = None             # why the engine is gone, once it is
        self.on_dead = None                      # called as on_dead(cause) on the event loop

    # ----- properties read by the API ------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def config(self):
        return self.engine.config

    @property
    def draft_format(self) -> str | None:
        """The upstream layout the EAGLE-3 head was read as (None without a head)."""
        return getattr(self.engine, "draft_format", None)

    @property
    def sampling_defaults(self) -> dict:
        """Defaults for sampling fields a request leaves out (fixed at engine start)."""
        return dict(getattr(self.engine, "sampling_defaults", {}))

    @property
    def stats(self) -> dict:
        """The latest `engine.stats()` snapshot (a dict that is replaced, never mutated)."""
        return self._stats

    @property
    def num_inflight(self) -> int:
        """Requests accepted and not yet finished: waiting + running + about to be added."""
        return len(self._streams)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's stop tokens (what ends a grammar's output)."""
        return list(getattr(self.engine, "eos_token_ids", None) or [])

    @property
    def stalled_for(self) -> float | None:
        """Seconds the engine has gone without progress while requests are pending, once that
        exceeds `stall_timeout_s`; else None (see "Liveness" in the module docstring)."""
        now = time.monotonic()
        since = getattr(self.engine, "stalled_since", None)
        elapsed = 0.0 if since is None else now - since
        if self._streams:
            heard = min(self._beat, getattr(self.engine, "last_heard", self._beat))
            elapsed = max(elapsed, now - heard)
        return elapsed if elapsed > self.stall_timeout_s else None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.stopping

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="adaspec-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Begin a graceful shutdown; safe to call from a signal handler or any thread.

        New requests are refused at once (`stopping`); requests still in flight after `timeout`
        seconds are finished with finish_reason "abort", so their clients get a complete response
        (partial text, usage, [DONE]) instead of a cut connection.
        """
        self.stopping = True
        if self._loop is not None:
            self._post(self._loop.call_later, timeout, self.abort_all)

    def abort_now(self) -> None:
        """`drain` with no time left: refuse new requests and end the in-flight ones at once
        (finish_reason "abort"); safe from a signal handler or any thread."""
        self.stopping = True
        if self._loop is not None:
            self._post(self.abort_all)

    def abort_all(self) -> None:
        """Finish every in-flight request now with finish_reason "abort" (event loop only)."""
        for rid in list(self._streams):
            stream = self._detach(rid)
            if self.metrics is not None:
                self.metrics.on_abort(stream)
            last = stream.last_output
            stream._put(RequestOutput(
                request_id=rid, prompt_token_ids=last.prompt_token_ids if last else stream.prompt_token_ids,
                token_ids=last.token_ids if last else [], text=last.text if last else None,
                new_token_ids=[], new_text="" if last is None or last.text is not None else None,
                finished=True, finish_reason="abort", spec=last.spec if last else {}))

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still in flight, fail its streams, and join the engine thread."""
        self.stopping = True
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.1fs (a step is still running)", timeout)
        for stream in list(self._streams.values()):
            stream._put(EngineError("the server is shutting down"))
        self._streams.clear()

    # ----- request API (event loop) -------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               arrival: float | None = None) -> RequestStream:
        """Register a request and queue it for the engine, synchronously (so `num_inflight` counts
        it at once); then await `accepted(stream)`. Raises EngineError if the engine is not running."""
        if not self.is_alive:
            raise EngineError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id, time.monotonic() if arrival is None else arrival)
        if isinstance(prompt, list):
            stream.prompt_token_ids = list(prompt)
        stream._accepted = concurrent.futures.Future()
        with self._lock:  # pairs with the engine thread's final drain: no add is ever orphaned
            if self._stopped.is_set():
                raise EngineError("the engine is not running")
            # Registered before the engine sees the request, so its first output always has a home.
            self._streams[request_id] = stream
            self._commands.put(("add", request_id, prompt, params, stream._accepted))
        return stream

    async def accepted(self, stream: RequestStream) -> RequestStream:
        """Wait until the engine has taken the request (between two steps).

        Raises the engine's ValueError (bad input) or EngineError (internal failure while adding).
        """
        try:
            await asyncio.wrap_future(stream._accepted)
        except BaseException:
            # Includes cancellation (client gone while waiting): the abort is a no-op if the
            # engine rejected the request, and releases it if it had been accepted.
            self._streams.pop(stream.request_id, None)
            stream.finished = True
            self._commands.put(("abort", stream.request_id))
            raise
        return stream

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival: float | None = None) -> RequestStream:
        """`submit` then `accepted`: the stream of an accepted request."""
        return await self.accepted(self.submit(request_id, prompt, params, arrival))

    def abort(self, request_id: str) -> None:
        """Drop a request (client went away). Idempotent; its KV is freed before the next step."""
        stream = self._detach(request_id)
        if stream is None:
            return
        if not stream.finished and self.metrics is not None:
            self.metrics.on_abort(stream)
        stream.finished = True

    def _detach(self, request_id: str) -> RequestStream | None:
        """Forget a stream and have the engine abort its request."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._commands.put(("abort", request_id))
        return stream

    # ----- engine thread ------------------------------------------------------------------------
    def _engine_alive(self) -> bool:
        return getattr(self.engine, "alive", True)   # (an engine process can die)

    def _safe_stats(self) -> dict:
        if not self._engine_alive():
            return getattr(self, "_stats", {})
        try:
            return dict(self.engine.stats())
        except Exception:  # stats are best-effort; never let them take the loop down
            if self._engine_alive():
                logger.exception("engine.stats() failed")
            return getattr(self, "_stats", {})

    def _run(self) -> None:
        try:
            while self._engine_alive():
                self._beat = time.monotonic()
                # A stalled engine (it planned nothing last step) waits for a command, such as
                # an abort that may unblock it, instead of spinning a core.
                busy = self.engine.has_unfinished() and not getattr(self.engine, "num_stalled_steps", 0)
                if not self._apply_commands(block=not busy):
                    break
                if not self.engine.has_unfinished():
                    continue
                self._step()
            else:
                cause = getattr(self.engine, "death_cause", None) or "the engine process died"
                self.dead = cause
                logger.error("%s; failing %d in-flight request(s) and shutting down", cause,
                             len(self._in_engine))
                self._fail_all(EngineError(cause))
                self._post(self._report_dead, cause)
        except BaseException:
            logger.exception("engine thread crashed")
            self._fail_all(EngineError("the engine thread crashed"))
            raise
        finally:
            with self._lock:
                self._stopped.set()
                self._reject_pending_adds()
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def _reject_pending_adds(self) -> None:
        """Commands that arrived after the loop ended would otherwise leave callers waiting."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[-1].set_exception(EngineError("the engine is not running"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; when `block`, wait for the first one. False means stop."""
        applied = False
        while True:
            try:
                cmd = self._commands.get(timeout=self._idle_poll_s) if block and not applied \
                    else self._commands.get_nowait()
            except queue.Empty:
                break
            applied = True
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "stop":
                for rid in list(self._in_engine):
                    self._abort(rid)
                self._stats = self._safe_stats()
                return False
        if applied or block:   # (idle: keeps the snapshot fresh, e.g. KV freed after an abort)
            self._stats = self._safe_stats()
        return True

    def _add(self, request_id: str, prompt, params: SamplingParams,
             done: concurrent.futures.Future) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as e:
            done.set_exception(e)
            return
        except Exception as e:
            if not self._engine_alive():   # reported once by the loop, not per request
                done.set_exception(EngineError("the engine is not running"))
                return
            logger.exception("adding request %s failed", request_id)
            done.set_exception(EngineError(f"internal error while adding the request: {e}"))
            return
        self._in_engine.add(request_id)
        done.set_result(None)

    def _abort(self, request_id: str) -> None:
        self._in_engine.discard(request_id)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            if self._engine_alive():
                logger.exception("aborting request %s failed", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            if not self._engine_alive():   # the loop reports it once and fails what is in flight
                return
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._in_engine))
            failed = list(self._in_engine)
            for rid in failed:
                self._abort(rid)
            self._stats = self._safe_stats()
            self._post(self._dispatch_errors, failed, EngineError(f"internal engine error: {e}"))
            return
        now = time.monotonic()
        for out in outputs:
            if out.finished or out.error:
                if out.error and not out.finished:
                    self._abort(out.request_id)
                self._in_engine.discard(out.request_id)
        # A fresh snapshot at most every STATS_EVERY_S while busy, always once idle (host time
        # of every step otherwise, on the thread the engine steps in).
        if now - self._stats_at >= STATS_EVERY_S or not self._in_engine:
            self._stats, self._stats_at = self._safe_stats(), now
        if outputs:
            self._post(self._dispatch, outputs, now)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    def _fail_all(self, exc: EngineError) -> None:
        failed = list(self._in_engine)
        self._in_engine.clear()
        self._post(self._dispatch_errors, failed, exc)

    # ----- event loop side of dispatch ------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:      # aborted by its client meanwhile
                continue
            if out.error:
                logger.error("request %s failed in the engine: %s", out.request_id, out.error)
                self._streams.pop(out.request_id, None)
                stream._put(EngineError(out.error))
                continue
            if self.metrics is not None:
                self.metrics.on_output(stream, out, now)
            stream.last_output = out
            if out.new_token_ids:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                stream.last_token_time = now
            if out.finished:
                self._streams.pop(out.request_id, None)
            stream._put(out)

    def _report_dead(self, cause: str) -> None:
        if self.on_dead is not None:
            self.on_dead(cause)

    def _dispatch_errors(self, request_ids: list[str], exc: EngineError) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(exc)
