"""A worker of a tensor-parallel engine (ranks 1..N-1, spawned by `tp_driver.TPDriver`).

It builds its shard of the model (`ModelRunner(cfg, tp=...)`: the same start-up phases as rank
0, in the same order, so the start-up collectives meet), then only executes: for every step
it receives the StepProgram down its pipe, the staged buffers by broadcast, and runs the
step's device work (`ModelRunner.execute_program`). It never plans, schedules or samples on
its own; the tokens it computes are the same as rank 0's (see `ModelRunner` in runner.py),
and rank 0 alone reads them back.

Events up its pipe: ("beat",) every HEARTBEAT_S from a thread of its own (a frozen worker goes
silent), ("error", text) before it exits on an exception.
"""
from __future__ import annotations

import os
import signal
import threading
import traceback

HEARTBEAT_S = 0.5


def _beat(events, stop: threading.Event, lock: threading.Lock) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            with lock:
                events.send(("beat",))
        except (BrokenPipeError, OSError):
            return


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when rank 0's process dies, however it dies."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(cfg, rank: int, size: int, init_method: str, cmd, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 stops its workers ("stop")
    _die_with_parent()
    from adaspec.parallel.group import disable_multicast
    disable_multicast()
    stop, lock = threading.Event(), threading.Lock()
    threading.Thread(target=_beat, args=(events, stop, lock), daemon=True).start()
    tp = None
    try:
        import torch

        from adaspec.device.select import resolve_device
        from adaspec.engine.runner import ModelRunner
        from adaspec.engine.step_program import ProgramCodec
        from adaspec.parallel.group import TPGroup, TPStartupError, rank_device

        device = rank_device(resolve_device(cfg.device), rank)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:   # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        tp = TPGroup.init(rank, size, device, init_method)
        try:
            runner = ModelRunner(cfg, tp=tp)
        except TPStartupError:
            return   # rank 0 reports it, naming the rank(s)
        codec = None
        with torch.inference_mode():
            while True:
                msg = cmd.recv()
                if msg[0] == "step":
                    prog = codec.loads(msg[1])
                    for name, n in (("stg", prog.nbytes), ("draft_stg", prog.draft_nbytes)):
                        if n:
                            tp.broadcast(codec.objects[name].dev[:n])
                    runner.execute_program(prog)
                elif msg[0] == "setup":
                    try:
                        runner.setup(msg[1])
                    except TPStartupError:
                        return
                    codec = ProgramCodec(runner)
                elif msg[0] == "stop":
                    return
    except EOFError:   # rank 0 is gone
        return
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which names this rank
        try:
            with lock:
                events.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)
    finally:
        stop.set()
        if tp is not None:
            try:
                tp.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
