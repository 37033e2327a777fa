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
