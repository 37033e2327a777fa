"""``bench.url``: the prompt set through any OpenAI-compatible server, streamed
(``/v1/chat/completions`` for chat contexts, ``/v1/completions`` for raw texts), ``concurrency``
requests in flight. TTFT and inter-token latency come from the stream's chunks; accept length and
per-position acceptance from the server's ``/metrics`` when it is specfw's (before/after)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

from tqdm import tqdm

from .drive import RunResult
from .prompts import BenchPrompt


class ServerError(RuntimeError):
    """The server refused or failed a benchmark request."""


def _headers(api_key: str | None) -> dict:
    key = api_key or os.environ.get("SPECFW_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(url: str, api_key: str | None) -> str:
    import httpx2

    try:
        r = httpx2.get(f"{url.rstrip('/')}/v1/models", headers=_headers(api_key), timeout=30)
        r.raise_for_status()
    except httpx2.HTTPError as e:
        raise ServerError(f"bench.url={url}: cannot list its models: {type(e).__name__}: {e}") from e
    return r.json()["data"][0]["id"]


def spec_metrics(url: str) -> dict | None:
    """specfw's speculative counters from ``/metrics`` (None: not a specfw server, or no metrics)."""
    import httpx2

    try:
        r = httpx2.get(f"{url.rstrip('/')}/metrics", timeout=10)
    except httpx2.HTTPError:
        return None
    if r.status_code != 200 or "specfw_spec_verify_forwards" not in r.text:
        return None
    out: dict = {"positions": {}}
    for line in r.text.splitlines():
        m = re.match(r"^(specfw_spec_\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "specfw_spec_position_accept_rate":
            out["positions"][int(re.search(r'position="(\d+)"', labels).group(1))] = value
        else:
            out[name.removeprefix("specfw_spec_")] = value
    return out


async def _one(client, url, model, i: int, prompt: BenchPrompt, params: dict, sem, bar, sink: list) -> None:
    body = dict(params, model=model, stream=True, stream_options={"include_usage": True})
    if prompt.messages:
        path, body["messages"] = "/v1/chat/completions", list(prompt.messages)
    else:
        path, body["prompt"] = "/v1/completions", prompt.text
    async with sem:
        t0 = time.perf_counter()
        times, text, tokens = [], [], None
        async with client.stream("POST", url.rstrip("/") + path, json=body) as r:
            if r.status_code != 200:
                raise ServerError(f"{path}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise ServerError(f"{path}: {chunk['error']}")
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") if prompt.messages else c.get("text")
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
        sink.append((i, t0, times, "".join(text), tokens if tokens is not None else len(times)))
        bar.update()


async def _run(url, model, prompts, params, concurrency, api_key, desc):
    import httpx2

    sem, sink = asyncio.Semaphore(concurrency), []
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False)
    limits = httpx2.Limits(max_connections=concurrency + 2)
    async with httpx2.AsyncClient(headers=_headers(api_key), timeout=httpx2.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, url, model, i, p, params, sem, bar, sink) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - t0
    bar.close()
    return sink, seconds


def run_server(
    url: str, prompts: list[BenchPrompt], max_new_tokens: int, temperature: float, ignore_eos: bool, concurrency: int, api_key=None, model=None, desc="server"
) -> RunResult:
    """Stream every prompt through the server at ``concurrency``; outputs are texts in prompt order."""
    model = model or served_model(url, api_key)
    params = {"max_tokens": max_new_tokens, "temperature": temperature}
    if ignore_eos:
        params["ignore_eos"] = True  # specfw / SGLang / vLLM extension
    import httpx2

    before = spec_metrics(url)
    try:
        sink, seconds = asyncio.run(_run(url, model, prompts, params, concurrency, api_key, desc))
    except httpx2.HTTPError as e:
        raise ServerError(f"bench.url={url}: {type(e).__name__}: {e}") from e
    after = spec_metrics(url) if before is not None else None
    sink.sort(key=lambda s: s[0])
    ttft = [times[0] - t0 for _, t0, times, _, _ in sink if times]
    itl = [b - a for _, _, times, _, _ in sink for a, b in zip(times, times[1:])]
    accept, positions = None, []
    if after is not None:
        v = after.get("verify_forwards", 0) - before.get("verify_forwards", 0)
        acc = after.get("accepted_draft_tokens", 0) - before.get("accepted_draft_tokens", 0)
        accept = (acc + v) / v if v else None
        positions = [round(after["positions"][k], 4) for k in sorted(after["positions"])]  # cumulative over the server's life
    return RunResult(
        outputs=[text for _, _, _, text, _ in sink],
        seconds=seconds,
        output_tokens=sum(n for *_, n in sink),
        ttft=ttft,
        itl=itl,
        accept_length=accept,
        per_position=positions,
    )
