"""The server's engine process (adaspec/server/engine_proc.py): same outputs as the engine in
process, bad requests refused on the server side, aborts, start-up errors, and a dead engine
process reported instead of hanging."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from adaspec import LLM, SamplingParams
from adaspec.config import EngineConfig
from adaspec.server.engine_proc import EngineProcess, EngineProcessDied
from helpers import prompts_of_lengths


def _drain(ep: EngineProcess, limit_s: float = 120.0) -> dict:
    finals, streamed = {}, {}
    t0 = time.monotonic()
    while ep.has_unfinished():
        assert time.monotonic() - t0 < limit_s, "engine process made no progress"
        for out in ep.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return finals, streamed


@pytest.mark.slow
def test_engine_process_matches_llm_and_aborts(llama_dir):
    prompts = prompts_of_lengths([5, 17, 3], seed=31)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 13)]
    ref = [o.token_ids for o in LLM(llama_dir, device="cpu", dtype="float32").generate(prompts, params)]
    ep = EngineProcess(EngineConfig.create(llama_dir, device="cpu", dtype="float32"))
    try:
        assert ep.max_model_len > 0 and ep.stats()["num_total_blocks"] > 0
        with pytest.raises(ValueError, match="out of range"):
            ep.add_request("bad", [10**9], params[0])       # refused here, before the engine sees it
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ep.add_request(str(i), p, sp)
        with pytest.raises(ValueError, match="already in use"):
            ep.add_request("0", prompts[0], params[0])
        finals, streamed = _drain(ep)
        assert [finals[str(i)].token_ids for i in range(3)] == ref
        assert all(streamed[str(i)] == ref[i] for i in range(3))
        # Snapshots are skipped while busy (STATS_EVERY_S) but the one that came with the last
        # outputs is fresh: the engine was idle by then.
        assert ep.stats()["generation_tokens"] == sum(map(len, ref)) and ep.stats()["num_running"] == 0
        assert finals["0"].prompt_token_ids == prompts[0] and finals["0"].finish_reason == "length"
        assert all(0.0 <= finals[str(i)].queue_time < 60 for i in range(3))   # timed in the engine, sent over
        # An aborted request produces nothing more and its KV comes back.
        ep.add_request("long", prompts[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        ep.step(timeout=1.0)
        ep.abort_request("long")
        assert not ep.has_unfinished()
        t0 = time.monotonic()
        while ep.stats()["num_free_blocks"] != ep.stats()["num_total_blocks"]:
            assert time.monotonic() - t0 < 30, "KV of the aborted request was not released"
            time.sleep(0.05)
    finally:
        ep.close()
    assert not ep._proc.is_alive()


@pytest.mark.slow
def test_engine_process_startup_error_and_death(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        EngineProcess(EngineConfig.create(llama_dir, device="cpu", dtype="float32", max_model_len=10**7))
    ep = EngineProcess(EngineConfig.create(llama_dir, device="cpu", dtype="float32"))
    ep.add_request("a", [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    os.kill(ep._proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessDied):
        for _ in range(200):
            ep.step(timeout=0.05)
    assert not ep.alive
    ep.close()


@pytest.mark.slow
def test_engine_process_killed_while_starting_is_reported(llama_dir):
    """A child that dies before it reports (killed while it imports and loads) is an
    EngineProcessDied that names the signal, not an error about the wrapper's own state."""
    got = {}

    def start():
        try:
            EngineProcess(EngineConfig.create(llama_dir, device="cpu", dtype="float32"))
        except BaseException as ex:  # noqa: BLE001 - what the constructor raised is the result
            got["ex"] = ex

    t = threading.Thread(target=start)
    t.start()
    deadline = time.monotonic() + 60
    while not (kids := [p for p in mp.active_children() if p.name == "adaspec-engine"]):
        assert time.monotonic() < deadline, "the engine process did not start"
        time.sleep(0.01)
    os.kill(kids[0].pid, signal.SIGKILL)   # long before it is ready: it is still importing torch
    t.join(60)
    assert isinstance(got.get("ex"), EngineProcessDied), got
    assert "killed by signal 9" in str(got["ex"])


def test_engine_process_profile_is_written_at_a_clean_stop(llama_dir, tmp_path, monkeypatch):
    """ADASPEC_ENGINE_PROFILE=PREFIX: the engine loop's cProfile stats land in PREFIX.<pid>.prof
    when the process is stopped, and they hold its steps."""
    import pstats

    monkeypatch.setenv("ADASPEC_ENGINE_PROFILE", str(tmp_path / "eng"))
    ep = EngineProcess(EngineConfig.create(llama_dir, device="cpu", dtype="float32"))
    try:
        ep.add_request("0", prompts_of_lengths([5], seed=33)[0], SamplingParams(max_tokens=4, temperature=0.0))
        _drain(ep)
    finally:
        ep.close()
    files = list(tmp_path.glob("eng.*.prof"))
    assert len(files) == 1
    stats = pstats.Stats(str(files[0])).stats
    assert any(name == "step" and path.endswith("engine.py") for path, _, name in stats)
