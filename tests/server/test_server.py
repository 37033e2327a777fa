"""The OpenAI-compatible server over a real uvicorn server on 127.0.0.1 with the demo model:
chat / completions (streaming and not), concurrency, n, seeds, stop, logprobs, usage, /generate,
/metrics, client disconnects, and ``specfw serve`` end to end."""

import concurrent.futures as cf
import json
import re
import socket
import time

import httpx2
import openai
import pytest

from server_helpers import CliProcess, ServerThread, engine_idle, free_port, wait_until
from specfw.sampling import SamplingParams

pytestmark = pytest.mark.model

QUESTIONS = ["Say hi", "What is 2+2?", "Name a color.", "Write one word about the sea."]
MAX_TOKENS = 16


def _msgs(q):
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def server(demo_engine):
    from specfw.server.app import create_app

    # one-at-a-time offline references, computed before the engine thread owns the engine
    refs = {q: demo_engine.generate([demo_engine.tokenize_chat(_msgs(q))], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0))[0] for q in QUESTIONS}
    app = create_app(demo_engine)
    with ServerThread(app) as srv:
        srv.engine, srv.state, srv.refs = demo_engine, app.state.specfw, refs
        yield srv
    assert not demo_engine.has_work and demo_engine.scheduler.kv_in_use == 0
    assert app.state.specfw.metrics.observer not in demo_engine.stats.observers


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, timeout=120) as c:
        yield c


def _chat(client, q, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=kw.pop("model", "SmolLM2-135M-Instruct"), messages=_msgs(q), **kw)


def _stream_text(stream):
    texts, finish, usage_chunks, n_chunks = {}, {}, [], 0
    for ch in stream:
        n_chunks += 1
        if not ch.choices:
            usage_chunks.append(ch.usage)
            continue
        for c in ch.choices:
            piece = getattr(c, "delta", None)
            piece = (piece.content if piece is not None else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage_chunks, n_chunks


# ---- basic endpoints ------------------------------------------------------------------------
def test_health_models_and_model_info(server, http, client):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    assert http.get(f"/v1/models/{server.engine.model_name}").json()["id"] == server.engine.model_name
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(server.engine.model_path)
    assert info["context_length"] == server.engine.runner.max_context and info["is_generation"] is True
    sinfo = http.get("/get_server_info").json()
    assert sinfo["engine_thread_alive"] is True and sinfo["config"]["engine"]["max_total_tokens"] == 8192


# ---- chat --------------------------------------------------------------------------------------
def test_chat_non_stream_matches_offline_engine(server, client):
    q = QUESTIONS[0]
    r = _chat(client, q)
    ref = server.refs[q]
    assert r.object == "chat.completion" and r.model == server.engine.model_name
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens == len(server.engine.tokenize_chat(_msgs(q)))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_and_reports_usage_last(server, client):
    q = QUESTIONS[1]
    stream = _chat(client, q, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(server.refs[q].token_ids)
    assert last.usage.prompt_tokens == server.refs[q].prompt_tokens
    texts, finish, _, _ = _stream_text(iter(chunks))
    assert texts[0] == server.refs[q].text and finish[0] == server.refs[q].finish_reason
    # without include_usage there is no usage chunk
    texts, _, usage_chunks, _ = _stream_text(_chat(client, q, stream=True))
    assert usage_chunks == [] and texts[0] == server.refs[q].text


def test_sse_wire_format(server, http):
    body = {"messages": _msgs(QUESTIONS[0]), "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        assert json.loads(ev[6:])["object"] == "chat.completion.chunk"


def test_concurrent_requests_equal_one_at_a_time(server, client):
    sequential = [_chat(client, q).choices[0].message.content for q in QUESTIONS]
    assert sequential == [server.refs[q].text for q in QUESTIONS]

    def one(i):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i % 2:  # mix streaming and non-streaming
            return _stream_text(_chat(client, q, stream=True))[0][0]
        return _chat(client, q).choices[0].message.content

    with cf.ThreadPoolExecutor(4) as ex:
        concurrent = list(ex.map(one, range(8)))
    assert concurrent == sequential * 2
    assert engine_idle(server)


def test_n_choices_use_consecutive_seeds(server, client):
    kw = dict(max_tokens=12, temperature=1.0, seed=7, n=2)
    r = _chat(client, QUESTIONS[2], **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(ref_ids(server, QUESTIONS[2]))  # the prompt is counted once
    assert 2 <= r.usage.completion_tokens <= 2 * 12
    again = _chat(client, QUESTIONS[2], **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    second = _chat(client, QUESTIONS[2], max_tokens=12, temperature=1.0, seed=8)
    assert second.choices[0].message.content == r.choices[1].message.content
    # streaming n=2 interleaves both choices and ends each with a finish_reason
    texts, finish, _, _ = _stream_text(_chat(client, QUESTIONS[2], stream=True, **kw))
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert set(finish) == {0, 1}


def test_stop_strings_and_stop_token_ids(server, client, http):
    ref = server.refs[QUESTIONS[0]]
    words = ref.text.split(" ")
    assert len(words) >= 3
    stop = " " + words[2]
    r = _chat(client, QUESTIONS[0], stop=[stop, "zzzz-never"])
    assert r.choices[0].message.content == ref.text[: ref.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = _chat(client, QUESTIONS[0], stop=stop)  # a plain string works too
    assert r.choices[0].finish_reason == "stop"
    g = http.post(
        "/generate",
        json={
            "input_ids": ref_ids(server, QUESTIONS[0]),
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "stop_token_ids": [ref.token_ids[3]]},
        },
    ).json()
    assert g["output_ids"] == ref.token_ids[:4]
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref.token_ids[3]}


def ref_ids(server, q):
    return server.engine.tokenize_chat(_msgs(q))


def test_sampling_extras_and_ignore_eos(server, client):
    r = _chat(
        client,
        QUESTIONS[3],
        max_completion_tokens=10,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


# ---- completions ---------------------------------------------------------------------------------
def test_completions_text_ids_and_stream_agree(server, client):
    prompt = "The capital of France is"
    ids = server.engine.tokenizer(prompt)["input_ids"]
    a = client.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0)
    b = client.completions.create(model=server.engine.model_name, prompt=ids, max_tokens=10, temperature=0)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 10
    texts, finish, usage, _ = _stream_text(
        client.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert texts[0] == a.choices[0].text and finish[0] == "length"
    assert usage[0].total_tokens == len(ids) + 10
    # a batch of prompts: choices are prompt-major
    batch = client.completions.create(model="default", prompt=[prompt, "Once upon a time"], max_tokens=10, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == a.choices[0].text


# ---- logprobs ---------------------------------------------------------------------------------------
def test_chat_logprobs(server, client):
    r = _chat(client, QUESTIONS[0], logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    streamed = [
        e for ch in _chat(client, QUESTIONS[0], logprobs=True, top_logprobs=3, stream=True) for c in ch.choices if c.logprobs for e in c.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    assert _chat(client, QUESTIONS[0]).choices[0].logprobs is None


def test_completion_logprobs(server, client):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(7))
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(x) for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    s = [
        c.logprobs
        for ch in client.completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2, stream=True)
        for c in ch.choices
        if c.logprobs
    ]
    assert [t for x in s for t in x.tokens] == lp.tokens
    assert [o for x in s for o in x.text_offset] == lp.text_offset


# ---- SGLang native ------------------------------------------------------------------------------
def test_generate_endpoint(server, http):
    ids = ref_ids(server, QUESTIONS[0])
    ref = server.refs[QUESTIONS[0]]
    g = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}).json()
    assert g["text"] == ref.text and g["output_ids"] == ref.token_ids
    meta = g["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(ref.token_ids)
    assert meta["finish_reason"]["type"] == ref.finish_reason
    text = server.engine.tokenizer.decode(ids)
    g2 = http.post(
        "/generate", json={"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "return_logprob": True, "top_logprobs_num": 2}
    ).json()
    assert g2["text"] == ref.text
    assert len(g2["meta_info"]["output_token_logprobs"]) == len(ref.token_ids)
    assert all(len(t) == 2 for t in g2["meta_info"]["output_top_logprobs"])
    # streaming: cumulative text, then [DONE]
    with http.stream("POST", "/generate", json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == ref.text and chunks[-1]["meta_info"]["finish_reason"]["type"] == ref.finish_reason
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))
    # batch
    b = http.post("/generate", json={"text": ["Hello", "Goodbye"], "sampling_params": {"max_new_tokens": 4}}).json()
    assert isinstance(b, list) and len(b) == 2 and all(x["meta_info"]["completion_tokens"] <= 4 for x in b)


# ---- metrics ------------------------------------------------------------------------------------------
def _metric(text, name, **labels):
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def test_metrics(server, http, client):
    _chat(client, QUESTIONS[0])
    list(_chat(client, QUESTIONS[0], stream=True))
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    t = r.text
    assert _metric(t, "specfw_requests_total", endpoint="/v1/chat/completions", finish_reason="length") >= 2
    assert _metric(t, "specfw_prompt_tokens_total") > 0 and _metric(t, "specfw_generation_tokens_total") > 0
    assert _metric(t, "specfw_time_to_first_token_seconds_count") >= 2
    assert _metric(t, "specfw_inter_token_latency_seconds_count") > 0
    assert _metric(t, "specfw_e2e_request_latency_seconds_count") >= 2
    assert _metric(t, "specfw_num_queue_reqs") == 0 and _metric(t, "specfw_num_running_reqs") == 0
    assert _metric(t, "specfw_kv_cache_usage") == 0 and _metric(t, "specfw_kv_cache_total_tokens") == 8192
    assert _metric(t, "specfw_spec_verify_forwards_total") == 0
    assert _metric(t, "specfw_spec_accept_length") == 0
    assert _metric(t, "specfw_decode_steps_total") > 0
    assert "_created" not in t


def test_usage_reports_prompt_tokens_from_the_prefix_cache(server, http, client):
    """A repeated prompt reuses its KV (all but its last token, whose logits give the first new
    one): OpenAI's ``usage.prompt_tokens_details.cached_tokens``, SGLang's ``meta_info.cached_tokens``
    and ``specfw_cache_hit_rate``; the answer is the offline one; /flush_cache empties the cache."""
    q = QUESTIONS[2]
    assert engine_idle(server, 15) and http.post("/flush_cache").status_code == 200
    assert _metric(http.get("/metrics").text, "specfw_prefix_cache_tokens") == 0
    first = _chat(client, q)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = _chat(client, q)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content == server.refs[q].text
    stream = list(_chat(client, q, stream=True, stream_options={"include_usage": True}))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    ids = server.engine.tokenize_chat(_msgs(q))
    r = http.post("/generate", json={"input_ids": ids + [28], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] == len(ids)
    t = http.get("/metrics").text
    assert _metric(t, "specfw_cache_hit_rate") > 0 and _metric(t, "specfw_prefix_cache_tokens") > len(ids)
    assert _metric(t, "specfw_kv_cache_used_tokens") == 0  # the cache's entries are not held by a request
    assert http.post("/flush_cache").status_code == 200
    assert _metric(http.get("/metrics").text, "specfw_prefix_cache_tokens") == 0
    assert server.engine.runner.allocator.num_used == 0


# ---- client disconnects ---------------------------------------------------------------------------------
def _raw_post(port, path, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def _long_stream(server, events: int):
    """A raw socket streaming a long chat completion, read until ``events`` SSE events arrived:
    (the socket, the bytes read so far)."""
    s = _raw_post(server.port, "/v1/chat/completions", {"messages": _msgs(QUESTIONS[0]), "stream": True, **LONG})
    buf = b""
    while buf.count(b"data: ") < events:
        chunk = s.recv(4096)
        assert chunk, "server closed the stream early"
        buf += chunk
    return s, buf


def test_disconnect_mid_stream_aborts_and_frees_kv(server, client, http):
    before = _metric(http.get("/metrics").text, "specfw_requests_total", endpoint="/v1/chat/completions", finish_reason="abort") or 0
    s, buf = _long_stream(server, 5)
    assert b" 200 OK" in buf.split(b"\r\n", 1)[0]
    assert server.engine.runner.allocator.num_used > 0
    s.close()
    assert engine_idle(server, 15), "the aborted request kept running"
    after = _metric(http.get("/metrics").text, "specfw_requests_total", endpoint="/v1/chat/completions", finish_reason="abort")
    assert after == before + 1
    assert _chat(client, QUESTIONS[0]).choices[0].message.content == server.refs[QUESTIONS[0]].text


def test_flush_cache_is_refused_while_a_request_is_in_flight(server, http):
    """POST /flush_cache (SGLang's): 400 with an OpenAI-style error while a stream runs, 200 once idle."""
    s, _ = _long_stream(server, 3)
    r = http.post("/flush_cache")
    assert r.status_code == 400 and r.json()["error"]["code"] == "cache_not_flushed"
    s.close()
    assert engine_idle(server, 15)
    assert http.post("/flush_cache").status_code == 200


def test_disconnect_before_non_stream_response_aborts(server, client):
    s = _raw_post(server.port, "/v1/completions", {"prompt": "Tell me a long story.", **LONG})
    assert wait_until(lambda: server.state.bridge.snapshot.running == 1, 20)
    time.sleep(0.3)
    s.close()
    assert engine_idle(server, 15), "the aborted request kept running"
    assert _chat(client, QUESTIONS[0]).choices[0].message.content == server.refs[QUESTIONS[0]].text


# ---- specfw serve ----------------------------------------------------------------------------------------
def test_cli_serve_end_to_end(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", f"server.port={port}", "engine.max_total_tokens=2048", "engine.num_threads=2", "engine.decode_log_interval=4"]
    with CliProcess(args, tmp_path / "serve.log") as p:
        assert p.healthy(url), p.output()[-3000:]
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="default", messages=_msgs("Say hi"), max_tokens=8, temperature=0)
        assert r.usage.completion_tokens > 0
    out = p.output()
    assert "Prefill batch" in out and "Decode batch" in out, out[-3000:]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in out, out[-3000:]
    assert "Uvicorn running" in out or "Application startup complete" in out


def test_ctrl_c_ends_open_streams_at_once(tmp_path):
    """SIGINT while a long stream runs: the stream ends with a 503-style `shutting_down` error
    event, the process exits promptly (not after uvicorn's graceful timeout), no traceback."""
    import threading

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    lines, first = [], threading.Event()

    def stream():
        body = {"model": "default", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                first.set()

    args = ["serve", f"server.port={port}", "engine.max_total_tokens=4096", "engine.num_threads=2"]
    with CliProcess(args, tmp_path / "serve.log") as p:
        assert p.healthy(url), p.output()[-3000:]
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        t0 = time.monotonic()
        p.stop()
        t.join(30)
        assert time.monotonic() - t0 < 4.5  # uvicorn's graceful timeout is 5 s
    out = p.output()
    assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "shutting_down" and [x for x in lines if x][-1] == "data: [DONE]"
    assert len(events) < 3000


# ---- speculative decoding stats ------------------------------------------------------------------------
def test_speculative_stats_in_generate_and_metrics():
    """A speculative (ngram) engine: /generate's meta_info and /metrics carry verify/accept stats."""
    ngram = pytest.importorskip("specfw_plugins.ngram.config")
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.server.app import create_app

    eng = Engine(make_cfg(max_running_requests=4, max_total_tokens=4096, speculative=ngram.NgramConfig(algorithm="ngram")))
    with ServerThread(create_app(eng)) as srv, httpx2.Client(base_url=srv.url, timeout=60) as h:
        text = "Repeat exactly: one two three four five, one two three four five, one two three four five"
        g = h.post("/generate", json={"input_ids": eng.tokenize_chat(_msgs(text)), "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()
        assert g["meta_info"]["spec_verify_ct"] > 0 and g["meta_info"]["spec_accept_length"] >= 1
        assert h.get("/get_model_info").json()["speculative_algorithm"] == "ngram"
        t = h.get("/metrics").text
        assert _metric(t, "specfw_spec_verify_forwards_total") == eng.stats.verify_forwards > 0
        assert _metric(t, "specfw_spec_accept_length") == pytest.approx(eng.stats.accept_length) and eng.stats.accept_length >= 1
        assert 'specfw_spec_position_accept_rate{position="0"}' in t
