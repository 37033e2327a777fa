"""What a load balancer in front of several ``specfw serve`` replicas asks of each one: the
endpoints ``sglang-router`` (SGLang's Rust router, ``pip install specfw[router]``) calls on its
workers, with SGLang's names and shapes.

* ``GET /server_info`` (``/get_server_info`` is the older name, served by ``native_api``): the model
  id and the parallel layout (``tp_size`` = ``model.tp_size``, ``dp_size`` = 1) the router registers a worker with;
* ``GET /model_info``: as ``/get_model_info``;
* ``GET /get_load``, ``GET /v1/loads``: one entry per data-parallel rank (here one), SGLang's fields,
  for load-aware policies;
* ``POST /flush_cache``: the router broadcasts it; the prefix cache is emptied and drafters that
  learn from every request's tokens (the n-gram trie) forget them (``Engine.flush_cache``);
  200 when flushed, 400 while requests are in flight (as SGLang: nothing is flushed then);
* ``GET /health_generate``: healthy when the engine thread runs (as ``/health``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from .errors import APIError
from .native_api import get_model_info
from .state import get_state

router = APIRouter()


def worker_identity(raw: Request) -> dict:
    """The fields a router registers a worker by, as SGLang's server info has them."""
    st = get_state(raw)
    e = st.engine
    spec = getattr(e.cfg, "speculative", None)
    return {
        "model_id": st.model_name,
        "served_model_name": st.model_name,
        "model_path": str(e.model_path),
        "tokenizer_path": str(e.model_path),
        "tp_size": int(getattr(e.cfg.model, "tp_size", 1) or 1),
        "dp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "max_running_requests": int(e.scheduler.max_running),
        "max_total_tokens": int(e.runner.allocator.num_slots),
        "context_length": int(e.runner.max_context),
        "speculative_algorithm": getattr(spec, "algorithm", None),
        "version": raw.app.version,
    }


@router.get("/server_info")
async def server_info(raw: Request):
    from .native_api import get_server_info

    return {**worker_identity(raw), **(await get_server_info(raw))}


@router.get("/model_info")
async def model_info(raw: Request):
    return await get_model_info(raw)


def _loads(raw: Request) -> list[dict]:
    snap = get_state(raw).bridge.snapshot
    return [
        {
            "dp_rank": 0,
            "num_reqs": snap.running + snap.waiting,
            "num_running_reqs": snap.running,
            "num_waiting_reqs": snap.waiting,
            "num_tokens": snap.kv_used,
            "num_pending_tokens": 0,
            "kv_usage": snap.kv_usage,
            "ts_tic": time.time(),
        }
    ]


@router.get("/get_load")
async def get_load(raw: Request):
    return _loads(raw)


@router.get("/v1/loads")
async def v1_loads(raw: Request):
    return {"loads": _loads(raw)}


@router.api_route("/flush_cache", methods=["GET", "POST"], response_class=PlainTextResponse)  # one route: OPTIONS allows both
async def flush_cache(raw: Request):
    state = get_state(raw)
    if not await state.bridge.run(lambda engine: engine.flush_cache()):
        raise APIError(400, "Cache not flushed: requests are in flight. Retry when the server is idle.", None, "cache_not_flushed")
    return PlainTextResponse("Cache flushed.\n")


@router.get("/health_generate")
async def health_generate(raw: Request):
    if not get_state(raw).bridge.alive:
        return APIError(503, "engine thread is not running", None, "engine_down").response()
    return {"status": "ok"}
