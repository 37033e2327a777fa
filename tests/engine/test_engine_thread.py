"""The serving engine thread owns all torch work: ``AsyncEngine.build`` constructs the engine on
that thread (libgomp keeps a thread team per OS thread that ran parallel ops; two teams on a
2-core machine made every decode step ~1.8x slower), and a failing build raises in the caller."""

import asyncio
import threading

import pytest

from conftest import make_cfg
from specfw.sampling import SamplingParams
from specfw.server.async_engine import AsyncEngine


def test_engine_is_built_and_stepped_on_one_thread(tiny_model_dir):
    from specfw.engine import Engine

    seen = {}

    def factory():
        seen["built_on"] = threading.get_ident()
        return Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024))

    bridge = AsyncEngine.build(factory)
    try:
        assert bridge.alive and seen["built_on"] != threading.get_ident()
        engine_thread = bridge._thread.ident
        assert seen["built_on"] == engine_thread
        stepped_on = []
        params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)

        def run(eng):
            stepped_on.append(threading.get_ident())
            return eng.generate([[5, 6, 7]], params)[0].token_ids

        out = asyncio.run(bridge.run(run))
        assert len(out) == 4 and stepped_on == [engine_thread]
    finally:
        bridge.stop()
    assert not bridge.alive


def test_failed_build_raises_in_the_caller():
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(factory)


def test_metrics_snapshot_shows_what_a_run_command_did(tiny_model_dir, monkeypatch):
    # /flush_cache then /metrics: the reply to the first must not outrun the loop's snapshot (a
    # server test read 867 cached tokens after a flush). The loop's own snapshot is held back
    # here, as a slow loop iteration would hold it.
    from specfw.engine import Engine

    bridge = AsyncEngine.build(lambda: Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)))
    try:
        params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        asyncio.run(bridge.run(lambda eng: eng.generate([[5, 6, 7, 8, 9, 10]], params)))
        cached = asyncio.run(bridge.run(lambda eng: eng.scheduler.cache.size))
        assert cached > 0 and bridge.snapshot.prefix_cache_tokens == cached
        slow = threading.Event()
        monkeypatch.setattr(bridge, "_reclaim_idle_draft_slots", lambda: slow.wait(2.0))
        assert asyncio.run(bridge.run(lambda eng: eng.flush_cache()))
        assert bridge.snapshot.prefix_cache_tokens == 0
        slow.set()
    finally:
        bridge.stop()
