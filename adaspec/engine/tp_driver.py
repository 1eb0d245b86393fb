"""Rank 0 of a tensor-parallel engine: spawns one worker process per further rank, joins the
world with them, and sends them every step (`send`).

Per step, rank 0 plans once (scheduler, KV manager, policy), stages once (`ModelRunner._prepare`)
and then: the StepProgram's bytes go down each worker's pipe (host to host, a few KB), the
staged buffers go out by ONE broadcast each on the device (the step's one host->device copy
becomes: copy on rank 0, broadcast to the others). No per-layer round trip: inside the
forward the ranks meet only in the model's own collectives. Overlap keeps working: `send`
never waits for a worker's device work, only (on CPU, gloo) for its arrival in the broadcast.
The tokens are not broadcast: every rank verifies the same all-gathered logits with the same
seeded draws and so chooses the same tokens (`runner`). Rank 0 deciding and broadcasting them
would add a collective to every step, and the drafts, KV moves and draft refresh that follow
verification would still have to agree.

Failure (`Monitor`): a worker that exits, reports an error or stops sending heartbeats
(`ADASPEC_TP_HANG_S`, default 15 s) marks the engine failed: the next or current step raises
`TPWorkerFailed` naming the rank (in-flight requests fail with it; `Engine.alive` turns False,
the server's /health 503 and it exits non-zero). Rank 0 blocked in a collective that cannot
finish (NCCL waits for a dead peer forever) is taken down: the process group is aborted, and if
the step still has not returned after a grace period the process exits with status 70.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import wait

import torch

from adaspec.config import EngineConfig
from adaspec.engine.step_program import ProgramCodec, StepProgram
from adaspec.parallel.group import NO_MULTICAST_ENV, TPGroup, TPStartupError, rank_device
from adaspec.parallel.shard import Shard

log = logging.getLogger("adaspec")
GRACE_S = 5.0        # a step stuck this long after a worker failed: the process exits


class TPWorkerFailed(RuntimeError):
    """A tensor-parallel worker died or stopped responding; the engine cannot continue."""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPDriver:
    def __init__(self, cfg: EngineConfig, procs: list, cmds: list, events: list):
        self.cfg, self.procs, self.cmds, self.events = cfg, procs, cmds, events
        self.tp: TPGroup | None = None
        self.codec: ProgramCodec | None = None
        self.failure: str | None = None      # why the engine cannot continue, once it cannot
        self.busy_since: float | None = None  # rank 0 is inside a step (may block in a collective)
        self.closed = False
        self.monitor: threading.Thread | None = None

    @classmethod
    def start(cls, cfg: EngineConfig, device: torch.device) -> "TPDriver":
        """Spawn the workers and join the world as rank 0. Raises ValueError for a model the
        ranks cannot share, TPStartupError naming a rank that failed to start."""
        from adaspec.models.registry import parse_model_spec
        n = cfg.tensor_parallel_size
        Shard(0, n, cfg.enable_expert_parallel).check(parse_model_spec(cfg.model)[0])
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs, this host has {torch.cuda.device_count()}")
        os.environ.update(NO_MULTICAST_ENV)   # inherited by the workers, and read by NCCL here
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        procs, cmds, events = [], [], []
        from adaspec.engine.tp_worker import worker_main
        for rank in range(1, n):
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            ev_r, ev_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(cfg, rank, n, init, cmd_r, ev_w), name=f"adaspec-tp{rank}",
                            daemon=True)
            p.start()
            cmd_r.close()
            ev_w.close()
            procs.append(p)
            cmds.append(cmd_w)
            events.append(ev_r)
        d = cls(cfg, procs, cmds, events)
        atexit.register(d.close)
        try:
            d.tp = d._join(rank_device(device, 0), init)
        except BaseException:
            d.close()
            raise
        d.monitor = threading.Thread(target=d._watch, name="adaspec-tp-monitor", daemon=True)
        d.monitor.start()
        log.info("tensor parallelism: %d ranks (%s), workers %s", n, d.tp.backend, [p.pid for p in procs])
        return d

    def _join(self, device: torch.device, init: str) -> TPGroup:
        """Rank 0's init_process_group, watching the workers meanwhile: one that dies before
        it joined fails the start-up at once, named, instead of after the rendezvous timeout."""
        out: dict = {}

        def run():
            try:
                out["tp"] = TPGroup.init(0, self.cfg.tensor_parallel_size, device, init)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                out["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    raise TPStartupError(f"tensor-parallel rank {rank} exited with status {p.exitcode} while "
                                         f"starting{self._reason(rank)}")
        if "error" in out:
            raise out["error"]
        return out["tp"]

    def _reason(self, rank: int) -> str:
        """': <the error the worker reported>' if it sent one."""
        ev = self.events[rank - 1]
        try:
            while ev.poll():
                msg = ev.recv()
                if msg[0] == "error":
                    return f": {msg[1]}"
        except (EOFError, OSError):
            pass
        return ""

    # ---- the engine's calls ----------------------------------------------------------------
    def setup(self, max_model_len: int) -> None:
        self._post(("setup", max_model_len))

    def attach(self, codec: ProgramCodec) -> None:
        """The runner's codec, once its device state exists (after `setup`)."""
        self.codec = codec

    def send(self, prog: StepProgram) -> None:
        """Send one prepared step to every worker: its program, then its staged bytes."""
        self.check()
        self._post(("step", self.codec.dumps(prog)))
        self.broadcast(self.codec.objects["stg"].dev, prog.nbytes)
        self.broadcast(self.codec.objects["draft_stg"].dev, prog.draft_nbytes)

    def broadcast(self, buf: torch.Tensor, n: int) -> None:
        if n:
            self.tp.broadcast(buf[:n])

    def _post(self, msg) -> None:
        try:
            for c in self.cmds:
                c.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise self.error(e) from e

    def check(self) -> None:
        if self.failure is not None:
            raise TPWorkerFailed(self.failure)

    def error(self, cause: BaseException) -> TPWorkerFailed:
        """The error to raise for a collective or pipe that failed under a step: the worker's
        failure once the monitor has named it (it waits for it briefly), else the cause."""
        deadline = time.monotonic() + 2.0
        while self.failure is None and time.monotonic() < deadline and not self.closed:
            time.sleep(0.05)
        # Nothing named: rank 0 itself failed mid-step, and the workers are out of step with it.
        msg = self.failure or f"a tensor-parallel step failed on rank 0: {type(cause).__name__}: {cause}"
        self.failure = msg
        return TPWorkerFailed(msg)

    @contextlib.contextmanager
    def busy(self):
        """Around rank 0's work that meets the workers in collectives (start-up, steps): a
        worker failing meanwhile takes the process down if that work cannot return (`_take_down`)."""
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None

    @contextlib.contextmanager
    def step(self):
        """Around rank 0's part of a step: `busy`, and the error of a collective or pipe a
        failed worker broke turned into TPWorkerFailed."""
        self.check()
        try:
            with self.busy():
                yield
        except TPWorkerFailed:
            raise
        except Exception as e:
            raise self.error(e) from e

    # ---- failure ---------------------------------------------------------------------------
    def _watch(self) -> None:
        from adaspec.engine.tp_worker import HEARTBEAT_S
        hang = float(os.environ.get("ADASPEC_TP_HANG_S", "15"))
        heard = [time.monotonic()] * len(self.procs)
        waitables = {p.sentinel: i for i, p in enumerate(self.procs)}
        waitables.update({e: i for i, e in enumerate(self.events)})
        while not self.closed and self.failure is None:
            ready = wait(list(waitables), timeout=HEARTBEAT_S)
            now = time.monotonic()
            for w in ready:
                i = waitables[w]
                if w is self.procs[i].sentinel:
                    self.procs[i].join(timeout=1.0)   # reaped: its exit status is known
                    self._fail(f"tensor-parallel rank {i + 1} died (exit status {self.procs[i].exitcode})"
                               f"{self._reason(i + 1)}")
                    break
                try:
                    msg = w.recv()
                except (EOFError, OSError):
                    continue   # its sentinel follows
                heard[i] = now
                if msg[0] == "error":
                    self._fail(f"tensor-parallel rank {i + 1} failed: {msg[1]}")
                    break
            else:
                late = [i for i, t in enumerate(heard) if now - t > hang]
                if late and not self.closed:
                    self._fail(f"tensor-parallel rank {late[0] + 1} stopped responding (no heartbeat for "
                               f"{now - heard[late[0]]:.0f} s)")
        if self.failure is not None and not self.closed:
            self._take_down()

    def _fail(self, msg: str) -> None:
        if self.closed:
            return
        self.failure = msg
        log.error("%s: the engine cannot continue", msg)

    def _take_down(self) -> None:
        """A step blocked in a collective with a dead peer: abort the group so it errors; if it
        still has not returned after GRACE_S, exit the process (never a silent hang)."""
        if self.busy_since is None:
            return   # idle: the next step raises
        try:
            from torch.distributed.distributed_c10d import _abort_process_group
            if self.tp is not None and self.tp.backend == "nccl":
                _abort_process_group()
        except Exception as e:  # noqa: BLE001 - the exit below still stops the hang
            log.warning("aborting the process group failed: %s", e)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not self.closed:
            if self.busy_since is None:
                return
            time.sleep(0.1)
        if not self.closed:
            log.critical("%s; rank 0 is blocked in a collective: exiting", self.failure)
            logging.shutdown()
            os._exit(70)

    def close(self) -> None:
        """Stop the workers and leave the world (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for c in self.cmds:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5.0 if self.failure is None else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        if self.tp is not None:
            try:
                self.tp.close()
            except Exception as e:  # noqa: BLE001 - closing after a failure may fail too
                log.debug("destroy_process_group: %s", e)
