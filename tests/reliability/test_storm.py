"""Disconnect storm: 120 streaming clients at once, 30 of them (25%) dropping mid-stream, plain
and eagle3 on the demo model; afterwards nothing runs or waits and no target or draft KV slot is in
use, and the server still answers."""

import asyncio
import time

import httpx2
import pytest

from server_helpers import wait_until
from .servers import engine_counts, serve

CLIENTS, DROPPERS, MAX_TOKENS = 120, 30, 24


def _speculative(kind):
    if kind == "plain":
        return {}
    from specfw_plugins.eagle3.config import Eagle3Config

    return {"speculative": Eagle3Config(algorithm="eagle3")}


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_disconnect_storm(demo_dir, kind, figures):
    from .sse_clients import stream

    with serve(max_total_tokens=8192, max_running_requests=32, **_speculative(kind)) as srv:
        body = {"prompt": "Write a long story about the sea.", "max_tokens": MAX_TOKENS, "temperature": 0.8, "ignore_eos": True, "stream": True}

        async def storm():
            tasks = [stream(srv.port, "/v1/completions", {**body, "seed": i}, drop_after=(2 + i % 5) if i % 4 == 0 else None) for i in range(CLIENTS)]
            return await asyncio.gather(*tasks)

        t0 = time.monotonic()
        results = asyncio.run(storm())
        seconds = time.monotonic() - t0
        dropped = sum(r["dropped"] for r in results)
        done = [r for r in results if not r["dropped"]]
        with httpx2.Client(base_url=srv.url, timeout=60) as http:
            assert wait_until(lambda: engine_counts(srv, http)["running"] == 0 and engine_counts(srv, http)["kv_used"] == 0, 60)
            after = engine_counts(srv, http)
            ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code
        figures.update(kind=kind, clients=CLIENTS, dropped=dropped, completed=len(done), seconds=round(seconds, 1), after=after)
    assert dropped == DROPPERS and all(r["status"] == 200 for r in results)
    assert all(r["events"][-1]["choices"][0]["finish_reason"] == "length" for r in done)
    assert after["running"] == after["queued"] == after["kv_used"] == after["draft_kv_used"] == 0
    assert (after["draft_kv_total"] > 0) == (kind == "eagle3")
    assert ok == 200
