"""Servers for the reliability suite: a real uvicorn server on 127.0.0.1 over a real engine."""

from __future__ import annotations

import contextlib

from server_helpers import ServerThread


def make_cfg(**engine_kw):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig

    model_kw = {k[6:]: engine_kw.pop(k) for k in list(engine_kw) if k.startswith("model_")}
    spec = engine_kw.pop("speculative", None) or SpeculativeConfig()
    return SpecfwConfig(model=ModelConfig(**model_kw), engine=EngineConfig(**engine_kw), speculative=spec)


@contextlib.contextmanager
def serve(api_key: str | None = None, max_request_bytes: int | None = None, **cfg):
    from specfw.engine import Engine
    from specfw.server.app import create_app

    eng = Engine(make_cfg(**cfg))
    kw = {"max_request_bytes": max_request_bytes} if max_request_bytes else {}
    app = create_app(eng, api_key=api_key, **kw)
    with ServerThread(app) as srv:
        srv.engine, srv.state = eng, app.state.specfw
        yield srv


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def engine_counts(srv, http) -> dict:
    """Running / queued requests and target / draft KV slots in use, as /metrics reports them."""
    t = http.get("/metrics").text
    return {
        k: int(metric(t, m))
        for k, m in [
            ("running", "specfw_num_running_reqs"),
            ("queued", "specfw_num_queue_reqs"),
            ("kv_used", "specfw_kv_cache_used_tokens"),
            ("draft_kv_used", "specfw_draft_kv_cache_used_tokens"),
            ("draft_kv_total", "specfw_draft_kv_cache_total_tokens"),
        ]
    }
