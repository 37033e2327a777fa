"""One poisoned request in a running batch of 8 fails alone (a real failure: its temperature is
set to NaN while it runs, so sampling it raises inside the worker); the other 7 complete with the
same text as in a batch of 8 without it. Then a large body arrives while a stream runs: the
stream's worst inter-token gap stays under 1 s."""

import asyncio
import json
import math
import time

import httpx2
import pytest

from server_helpers import wait_until
from .servers import engine_counts, serve

LIMIT = 4 * 2**20
QUESTIONS = [
    "Say hi",
    "What is 2+2?",
    "Name a color.",
    "Write one word about the sea.",
    "Count to five.",
    "What is the capital of France?",
    "Name an animal.",
    "Spell cat.",
]


@pytest.fixture(scope="module")
def server(demo_dir):
    with serve(max_total_tokens=16384, max_running_requests=8, max_request_bytes=LIMIT) as srv:
        yield srv


def _batch(srv, poison_index=None):
    from .sse_clients import stream

    body = {"max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run():
        tasks = [asyncio.ensure_future(stream(srv.port, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": q}]})) for q in QUESTIONS]
        if poison_index is not None:
            while srv.state.bridge.snapshot.running < len(QUESTIONS):
                await asyncio.sleep(0.01)

            def poison(engine):
                victim = next(
                    r
                    for r in engine.scheduler.running
                    if r.rid.endswith("-0") and r.prompt_ids == engine.tokenize_chat([{"role": "user", "content": QUESTIONS[poison_index]}])
                )
                victim.params.temperature = math.nan

            srv.state.bridge.call(poison)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    texts = []
    for r in results:
        ev = r["events"]
        if "error" in ev[-1]:
            texts.append(ev[-1]["error"])
        else:
            texts.append("".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e["choices"]))
    return texts


def test_poisoned_request_fails_alone(server, figures):
    clean = _batch(server)
    failures_before = server.engine.stats.step_failures
    poisoned = _batch(server, poison_index=3)
    assert isinstance(poisoned[3], dict) and poisoned[3]["code"] == "engine_error", poisoned[3]
    same = [poisoned[i] == clean[i] for i in range(len(QUESTIONS)) if i != 3]
    with httpx2.Client(base_url=server.url, timeout=60) as http:
        assert wait_until(lambda: engine_counts(server, http)["kv_used"] == 0, 30)
        after = engine_counts(server, http)
    figures.update(
        batch=len(QUESTIONS),
        failed=1,
        completed_same_text=sum(same),
        step_failures=server.engine.stats.step_failures - failures_before,
        error=poisoned[3]["message"],
        after=after,
    )
    assert all(same), [(clean[i], poisoned[i]) for i in range(len(QUESTIONS)) if i != 3]
    assert after["running"] == after["queued"] == 0 and not server.engine.quarantine.suspects


def test_large_body_does_not_stall_a_stream(server, figures):
    from .sse_clients import stream

    big_prompt = "hello world, this is a long prompt. " * ((LIMIT - 4096) // 36)
    big = json.dumps({"prompt": big_prompt, "max_tokens": 4}).encode()
    assert len(big) < LIMIT

    async def run():
        s = asyncio.ensure_future(
            stream(server.port, "/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True})
        )
        while server.state.bridge.snapshot.running < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        async with httpx2.AsyncClient(base_url=server.url, timeout=120) as h:
            t0 = time.monotonic()
            r = await h.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            big_s = time.monotonic() - t0
        # over the limit: the answer comes before the body is sent at all
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {2 * LIMIT}\r\n\r\n".encode())
        status413 = int((await reader.readuntil(b"\r\n")).split()[1])
        s413 = time.monotonic() - t0
        writer.close()
        return await s, r, big_s, status413, s413

    res, r, big_s, r413, s413 = asyncio.run(run())
    gaps = [b - a for a, b in zip(res["times"], res["times"][1:])]
    figures.update(
        body_bytes=len(big),
        status=r.status_code,
        code=r.json()["error"]["code"],
        seconds_to_answer=round(big_s, 2),
        stream_tokens=len(res["events"]),
        worst_gap_s=round(max(gaps), 3),
        median_gap_s=round(sorted(gaps)[len(gaps) // 2], 3),
        over_limit_status=r413,
        over_limit_seconds=round(s413, 3),
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r413 == 413
    assert max(gaps) < 1.0, figures
