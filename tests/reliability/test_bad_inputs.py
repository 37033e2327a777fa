"""The bad-input table of issue 16: each row is one request that must get its 4xx with an
OpenAI error body (a ``code`` on every one), on a server that keeps serving."""

import json

import httpx2
import pytest

from .servers import engine_counts, serve

CHAT, COMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
KEY = "table-key"
LIMIT = 256 * 1024
MSG = '"messages":[{"role":"user","content":"hi"}]'

TABLE = [  # (path, raw JSON body, status, code, param)
    # 1. non-finite numbers, everywhere a number enters
    *[
        (p, "{" + base + f',"{f}":{v}' + "}", 400, "invalid_value", f)
        for p, base in [(CHAT, MSG), (COMPL, '"prompt":"hi"')]
        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for v in ("NaN", "Infinity")
    ],
    *[
        (GEN, '{"text":"hi","sampling_params":{"%s":NaN}}' % f, 400, "invalid_value", f"sampling_params.{f}")
        for f in ("temperature", "top_p", "repetition_penalty")
    ],
    # 2. lone surrogates
    (CHAT, '{"messages":[{"role":"user","content":"\\ud800x"}]}', 400, "invalid_unicode", "messages.0.content"),
    (COMPL, '{"prompt":"\\ud800x"}', 400, "invalid_unicode", "prompt"),
    (GEN, '{"text":"\\ud800x"}', 400, "invalid_unicode", "text"),
    # 5. booleans as token ids
    (GEN, '{"input_ids":[false]}', 400, "invalid_value", "input_ids.0"),
    (COMPL, '{"prompt":[[true]]}', 400, "invalid_value", "prompt.0.0"),
    # 6. can never fit the KV pool (2048 slots)
    (
        GEN,
        json.dumps({"input_ids": [5] * 2040, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}),
        400,
        "context_length_exceeded",
        "sampling_params.max_new_tokens",
    ),
    (COMPL, json.dumps({"prompt": [5] * 2040, "max_tokens": 16}), 400, "context_length_exceeded", "max_tokens"),
    # 7. n beyond the queue bound (8)
    (COMPL, '{"prompt":"hi","n":9}', 400, "invalid_value", "n"),
    # 8. codes on every 400, OpenAI's temperature range, out-of-vocab stop ids, empty text, ...
    (COMPL, '{"prompt":"hi","top_p":2}', 400, "invalid_value", "top_p"),
    (COMPL, '{"prompt":""}', 400, "invalid_value", "prompt"),
    (COMPL, '{"prompt":[1,49152]}', 400, "invalid_value", "prompt"),
    (COMPL, '{"prompt":"hi","temperature":2.5}', 400, "invalid_value", "temperature"),
    (COMPL, '{"prompt":"hi","temperature":1e308}', 400, "invalid_value", "temperature"),
    (COMPL, '{"prompt":"hi","stop_token_ids":[-1]}', 400, "invalid_value", "stop_token_ids.0"),
    (COMPL, '{"prompt":"hi","stop_token_ids":[99999999999]}', 400, "invalid_value", "stop_token_ids"),
    (GEN, '{"text":[]}', 400, "invalid_value", "text"),
    (GEN, '{"text":"hi","sampling_params":{"n":0}}', 400, "invalid_value", "sampling_params.n"),
    (COMPL, '{"prompt":"hi","echo":true}', 400, "unsupported_parameter", "echo"),
    (CHAT, "{" + MSG + ',"tools":[{"type":"function"}]}', 400, "unsupported_parameter", "tools"),
    (CHAT, "{" + MSG + ',"top_logprobs":3}', 400, "invalid_value", "top_logprobs"),
    (CHAT, '{"messages":[', 400, "invalid_json", None),
    (CHAT, "[1,2]", 400, "invalid_json", None),
    (COMPL, '{"prompt":"hi","model":"gpt-17"}', 404, "model_not_found", "model"),
]


@pytest.fixture(scope="module")
def server(demo_dir):
    with serve(api_key=KEY, max_request_bytes=LIMIT, max_total_tokens=2048, max_queued_requests=8, max_running_requests=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, timeout=120, headers={"Authorization": f"bearer {KEY}"}) as c:
        yield c


@pytest.mark.parametrize("path,body,status,code,param", TABLE)
def test_bad_input(http, path, body, status, code, param):
    r = http.post(path, content=body.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["code"] == code and e["param"] == param and e["message"], e


def test_too_large_and_auth(server, http, figures):
    r = http.post(COMPL, content=b'{"prompt":"' + b"x" * LIMIT + b'"}', headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx2.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx2.get(server.url + "/v1/models", headers={"Authorization": f"BEARER {KEY}"}, timeout=30).status_code == 200
    assert http.get("/health").json() == {"status": "ok"}
    figures.update(rows=len(TABLE), after=engine_counts(server, http))
    assert engine_counts(server, http)["kv_used"] == 0
