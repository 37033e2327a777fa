"""Bad input, API keys, queue overflow and engine failures against a real uvicorn server: every
error is an OpenAI-style body with the documented status, and the server keeps serving."""

import concurrent.futures as cf
import json
import socket

import httpx2
import openai
import pytest

from server_helpers import ServerThread, wait_until, engine_idle
from specfw.sampling import SamplingParams
from specfw.server.submission import Prompt, Submission

pytestmark = pytest.mark.model

CHAT, COMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def server(demo_engine):
    from specfw.server.app import create_app

    app = create_app(demo_engine)
    with ServerThread(app) as srv:
        srv.engine, srv.state = demo_engine, app.state.specfw
        yield srv
    assert not demo_engine.has_work and demo_engine.scheduler.kv_in_use == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, timeout=60) as c:
        yield c


def _err(r, status, param="<any>", code="<any>"):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "<any>":  # the field, or an item of it ("prompt.1")
        got = body["error"]["param"]
        assert got == param or (param and got and got.startswith(param + ".")), body
    if code != "<any>":
        assert body["error"]["code"] == code, body
    return body["error"]


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def chat(**kw):
    body = {"messages": MSGS, "max_tokens": 4, "temperature": 0}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()


# ---- malformed requests -------------------------------------------------------------------------
def test_malformed_json_and_non_object_bodies(server, http):
    for path in (CHAT, COMPL, GEN):
        _err(http.post(path, content=b'{"messages": [', headers={"content-type": "application/json"}), 400, None, "invalid_json")
        _err(http.post(path, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
        _err(http.post(path, content=b"hello", headers={"content-type": "text/plain"}), 400)
        _err(http.post(path), 400)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", "abc"),
        ("max_tokens", 1.5),
        ("temperature", "hot"),
        ("messages", "hi"),
        ("stop", 5),
        ("n", "two"),
        ("stream", "maybe"),
        ("seed", 1.5),
        ("top_k", [1]),
        ("stop_token_ids", ["a"]),
        ("logprobs", "yes"),
    ],
)
def test_wrong_field_types(http, field, value):
    e = _err(http.post(CHAT, json=chat(**{field: value})), 400)
    assert e["param"].split(".")[0] == field


def test_bad_messages(http):
    _err(http.post(CHAT, json=chat(messages=[])), 400, "messages")
    _err(http.post(CHAT, json=chat(messages=DROP)), 400, "messages")
    _err(http.post(CHAT, json=chat(messages=[{"role": "wizard", "content": "x"}])), 400, "messages.0.role")
    _err(http.post(CHAT, json=chat(messages=[{"content": "x"}])), 400, "messages.0.role")
    _err(
        http.post(CHAT, json=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
        400,
        "messages.0.content.0.type",
        "unsupported_parameter",
    )
    # text parts and developer role are accepted
    _ok(http.post(CHAT, json=chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])))


def test_bad_prompts(server, http):
    _err(http.post(COMPL, json={"prompt": "", "max_tokens": 4}), 400, "prompt")
    _err(http.post(COMPL, json={"prompt": [], "max_tokens": 4}), 400, "prompt")
    _err(http.post(COMPL, json={"max_tokens": 4}), 400, "prompt")
    _err(http.post(COMPL, json={"prompt": [1, 2, 10**9], "max_tokens": 4}), 400, "prompt")
    _err(http.post(COMPL, json={"prompt": [1, -5], "max_tokens": 4}), 400, "prompt")
    _err(http.post(GEN, json={"text": "a", "input_ids": [1]}), 400, "text")
    _err(http.post(GEN, json={}), 400, "text")
    _err(http.post(GEN, json={"input_ids": [10**9]}), 400, "input_ids")


# ---- lengths ------------------------------------------------------------------------------------
def test_max_tokens_bounds(server, http):
    ctx = server.engine.runner.max_context
    for bad in (0, -1):
        _err(http.post(CHAT, json=chat(max_tokens=bad)), 400, "max_tokens")
        _err(http.post(CHAT, json=chat(max_tokens=DROP, max_completion_tokens=bad)), 400, "max_completion_tokens")
        _err(http.post(COMPL, json={"prompt": "Hi", "max_tokens": bad}), 400, "max_tokens")
        _err(http.post(GEN, json={"text": "Hi", "sampling_params": {"max_new_tokens": bad}}), 400, "sampling_params.max_new_tokens")
    e = _err(http.post(CHAT, json=chat(max_tokens=10**6)), 400, "max_tokens", "context_length_exceeded")
    assert str(ctx) in e["message"]
    _err(http.post(CHAT, json=chat(max_tokens=DROP, max_completion_tokens=ctx)), 400, "max_completion_tokens", "context_length_exceeded")
    _err(http.post(COMPL, json={"prompt": [5, 6, 7], "max_tokens": ctx - 2}), 400, "max_tokens")
    _err(http.post(GEN, json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": ctx}}), 400, "sampling_params.max_new_tokens")
    # the largest max_tokens that fits is accepted (ends quickly through a stop token)
    first = _ok(http.post(GEN, json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))
    r = _ok(http.post(COMPL, json={"prompt": [5, 6, 7], "max_tokens": ctx - 3, "temperature": 0, "stop_token_ids": first["output_ids"]}))
    assert r["choices"][0]["finish_reason"] == "stop"


def test_prompt_longer_than_context(server, http):
    ctx = server.engine.runner.max_context
    e = _err(http.post(COMPL, json={"prompt": [5] * (ctx + 10), "max_tokens": 4}), 400, "prompt", "context_length_exceeded")
    assert str(ctx) in e["message"]
    _err(http.post(COMPL, json={"prompt": [5] * ctx}), 400, "prompt", "context_length_exceeded")
    _err(http.post(CHAT, json=chat(messages=[{"role": "user", "content": "hello " * (ctx + 10)}])), 400, "messages", "context_length_exceeded")
    _err(http.post(GEN, json={"input_ids": [5] * (ctx + 1)}), 400, "input_ids", "context_length_exceeded")


def test_default_max_tokens_is_remaining_context_capped():
    """Unit test of the documented default (no max_tokens): min(context - prompt, KV pool room, cap)."""
    from types import SimpleNamespace

    made = []

    class FakeEngine:
        runner = SimpleNamespace(max_context=100, vocab_size=1000, allocator=SimpleNamespace(num_slots=4096))
        worker = SimpleNamespace(slots_per_decode=1)
        scheduler = SimpleNamespace(max_queued=0)

        def make_request(self, ids, params, rid=None):
            made.append((ids, params, rid))
            return SimpleNamespace(rid=rid)

    p = SamplingParams(temperature=0.5, seed=41)
    Submission([Prompt("ids", list(range(1, 91)))], p, n=3, default_max_tokens=64, rid_prefix="x").prepare(FakeEngine()).build(FakeEngine())
    assert [m[1].max_new_tokens for m in made] == [10, 10, 10]
    assert [m[1].seed for m in made] == [41, 42, 43] and [m[2] for m in made] == ["x-0", "x-1", "x-2"]
    made.clear()
    Submission([Prompt("ids", [1, 2])], p, default_max_tokens=64).prepare(FakeEngine()).build(FakeEngine())
    assert made[0][1].max_new_tokens == 64
    # a KV pool smaller than the context bounds the default too: 40 slots, 30 prompt tokens, tree of 4
    small = FakeEngine()
    small.runner = SimpleNamespace(max_context=100, vocab_size=1000, allocator=SimpleNamespace(num_slots=40))
    small.worker = SimpleNamespace(slots_per_decode=4)
    made.clear()
    Submission([Prompt("ids", list(range(30)))], p, default_max_tokens=64).prepare(small).build(small)
    assert made[0][1].max_new_tokens == 40 - 30 - 4 + 2


# ---- sampling values --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -3),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("n", 0),
        ("n", 1000),
    ],
)
def test_invalid_sampling_values(http, field, value):
    _err(http.post(CHAT, json=chat(**{field: value})), 400, field)
    _err(http.post(COMPL, json={"prompt": "Hi", "max_tokens": 4, field: value}), 400, field)


def test_invalid_logprob_settings(http):
    _err(http.post(CHAT, json=chat(logprobs=True, top_logprobs=25)), 400, "top_logprobs")
    _err(http.post(CHAT, json=chat(top_logprobs=2)), 400, "top_logprobs")
    _err(http.post(COMPL, json={"prompt": "Hi", "max_tokens": 4, "logprobs": 25}), 400, "logprobs")
    _err(http.post(COMPL, json={"prompt": "Hi", "max_tokens": 4, "logprobs": -1}), 400, "logprobs")
    _err(http.post(GEN, json={"text": "Hi", "return_logprob": True, "top_logprobs_num": 50}), 400, "top_logprobs_num")


def test_generate_sampling_params_validation(http):
    _err(http.post(GEN, json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}}), 400, "sampling_params.temprature")
    _err(http.post(GEN, json={"text": "Hi", "sampling_params": {"top_p": 2}}), 400, "sampling_params.top_p")
    _err(http.post(GEN, json={"text": "Hi", "sampling_params": {"n": 0}}), 400, "sampling_params.n")


def test_unsupported_features_are_rejected(http):
    _err(http.post(CHAT, json=chat(tools=[{"type": "function", "function": {"name": "f"}}])), 400, "tools")
    _err(http.post(CHAT, json=chat(response_format={"type": "json_object"})), 400, "response_format")
    _err(http.post(CHAT, json=chat(logit_bias={"5": 10})), 400, "logit_bias")
    _err(http.post(COMPL, json={"prompt": "Hi", "echo": True}), 400, "echo")
    _err(http.post(COMPL, json={"prompt": "Hi", "suffix": "x"}), 400, "suffix")
    _ok(http.post(CHAT, json=chat(user="someone", response_format={"type": "text"}, unknown_field=1)))


# ---- model names, routes ------------------------------------------------------------------------------
def test_model_names(server, http):
    e = _err(http.post(CHAT, json=chat(model="gpt-17")), 404, "model", "model_not_found")
    assert "gpt-17" in e["message"]
    _err(http.post(COMPL, json={"model": "nope", "prompt": "Hi", "max_tokens": 2}), 404, "model")
    _err(http.get("/v1/models/nope"), 404, "model")
    for name in (server.engine.model_name, "default", "", DROP):
        _ok(http.post(CHAT, json=chat(model=name)))


def test_unknown_route_and_method(http):
    _err(http.get("/v1/nothing"), 404)
    _err(http.get(CHAT), 405)


# ---- overload, failures, keys -------------------------------------------------------------------------
def test_queue_full_is_503(server, http):
    sched = server.engine.scheduler
    saved = sched.max_running, sched.max_queued
    sched.max_running, sched.max_queued = 1, 1
    body = {"messages": MSGS, "stream": True, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        data = json.dumps(body).encode()
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        assert s.recv(4096)  # A is running
        with cf.ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(http.post, COMPL, json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
            assert wait_until(lambda: server.state.bridge.snapshot.waiting == 1, 20)  # B waits
            full = http.post(COMPL, json={"prompt": "Hi", "max_tokens": 3})  # C
            _err(full, 503, None, "queue_full")
            assert full.headers["retry-after"] == "1"
            s.close()  # A disconnects → aborted, B runs
            assert waiting.result(60).status_code == 200
    finally:
        sched.max_running, sched.max_queued = saved
        s.close()
    assert engine_idle(server)
    assert 'specfw_request_errors_total{endpoint="/v1/completions",status="503"} 1.0' in http.get("/metrics").text


def test_engine_step_failure_fails_requests_with_500_and_keeps_serving(server, http, monkeypatch):
    eng = server.engine
    real_decode = eng.worker.decode
    calls = {"n": 0}

    def broken_decode(batch):
        calls["n"] += 1
        assert eng.runner.allocator.num_used >= len(batch.new_slots[0])  # this step's reservation is held
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(eng.worker, "decode", broken_decode)
    e = _err(http.post(CHAT, json=chat(max_tokens=8)), 500, None, "engine_error")
    assert "injected decode failure" in e["message"]
    with http.stream("POST", CHAT, json=chat(max_tokens=8, stream=True)) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert calls["n"] == 2
    assert engine_idle(server), "slots of the failed requests (and the step's reservation) were not freed"
    monkeypatch.setattr(eng.worker, "decode", real_decode)
    r = _ok(http.post(CHAT, json=chat(max_tokens=8)))
    assert r["usage"]["completion_tokens"] == 8
    assert _ok(http.get("/health")) == {"status": "ok"}
    assert "specfw_engine_step_failures_total 2.0" in http.get("/metrics").text


def test_api_key(server):
    """A second app on the same engine thread, with an API key, on its own uvicorn server."""
    from specfw.server.app import create_app

    app = create_app(server.state.bridge, api_key="sekret")
    with ServerThread(app) as srv, httpx2.Client(base_url=srv.url, timeout=60) as h:
        e = _err(h.post(CHAT, json=chat()), 401, None, "invalid_api_key")
        assert "Missing" in e["message"]
        _err(h.post(CHAT, json=chat(), headers={"Authorization": "Bearer wrong"}), 401, None, "invalid_api_key")
        _err(h.post(CHAT, json=chat(), headers={"Authorization": "sekret"}), 401)
        _err(h.get("/v1/models"), 401)
        _err(h.post(GEN, json={"text": "Hi"}), 401)
        assert h.post(CHAT, content=b"{bad", headers={"content-type": "application/json"}).status_code == 401
        _ok(h.post(CHAT, json=chat(), headers={"Authorization": "Bearer sekret"}))
        assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert c.chat.completions.create(model="default", messages=MSGS, max_tokens=3).usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
    # the shared engine thread survives the second app's shutdown
    assert server.state.bridge.alive
    _ok(httpx2.post(server.url + CHAT, json=chat(), timeout=60))


def test_errors_are_counted_and_server_still_healthy(server, http):
    # its own errors: under pytest-xdist the tests that make others may run on another worker's server
    _err(http.post(CHAT, json=chat(messages=[])), 400, "messages")
    _err(http.post(CHAT, json=chat(model="gpt-17")), 404, "model")
    t = http.get("/metrics").text
    assert 'specfw_request_errors_total{endpoint="/v1/chat/completions",status="400"}' in t
    assert 'specfw_request_errors_total{endpoint="/v1/chat/completions",status="404"}' in t
    assert _ok(http.get("/health")) == {"status": "ok"}
    assert engine_idle(server)


def test_duplicate_request_id_is_rejected(server, http):
    body = {"text": "Hi", "rid": "my-id", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}
    with http.stream("POST", GEN, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep a reference: closing it closes the stream
        next(lines)  # the first request is running
        _err(http.post(GEN, json={**body, "stream": False}), 400, "rid", "duplicate_request_id")
    assert engine_idle(server)
    assert _ok(http.post(GEN, json={**body, "stream": False, "sampling_params": {"max_new_tokens": 2}}))["meta_info"]["id"] == "my-id-0"
