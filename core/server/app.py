"""The FastAPI app (``create_app``) and ``run_server(cfg)`` behind ``specfw serve``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models[/{model}]``,
``POST /generate``, ``GET /get_model_info``, ``GET /get_server_info`` (these need
``Authorization: Bearer <server.api_key>`` when a key is set) and ``GET /health``,
``GET /metrics`` (always open, for load balancers and Prometheus). ``/openapi.json`` describes
them (``openapi.py``); bodies over ``max_request_bytes`` get 413 before parsing (``limits.py``).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import time

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine import Engine
from . import errors
from .async_engine import AsyncEngine
from .errors import APIError
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from .metrics import ServerMetrics
from .native_api import router as native_router
from .router_api import router as router_api_router
from .openai_api import router as openai_router
from .openapi import OPEN_PATHS, build_openapi
from .state import ServerState
from .submission import DEFAULT_MAX_TOKENS

logger = logging.getLogger("specfw.server")

API_KEY_ENV = "SPECFW_API_KEY"  # read when server.api_key is not set (keeps the key out of `ps`)


class APIKeyMiddleware:
    """Pure ASGI middleware (keeps streaming and disconnect detection intact): every path except
    ``OPEN_PATHS`` needs ``Authorization: Bearer <key>`` (the scheme name in any case)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = got.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        msg = "Missing API key: send 'Authorization: Bearer <key>'" if not got else "Invalid API key"
        state = getattr(scope.get("app"), "state", None)
        err = APIError(401, msg, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if state is not None and hasattr(state, "specfw"):
            state.specfw.metrics.on_error(scope["path"], 401)
        await err.response()(scope, receive, send)


def create_app(
    engine: Engine | AsyncEngine,
    *,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    owns: bool | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """An app serving ``engine``. Given an ``Engine``, the app owns a new engine thread (started
    and stopped with the app's lifespan); given an ``AsyncEngine``, the thread is shared (started if
    needed, never stopped by the app, unless ``owns=True``), so several apps can serve one engine."""
    owns = isinstance(engine, Engine) if owns is None else owns
    bridge = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    metrics = ServerMetrics(bridge, bridge.engine.model_name)
    state = ServerState(bridge, metrics, api_key=api_key or None, default_max_tokens=default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.call(lambda eng: eng.stats.observers.append(metrics.observer))
        bridge.start()
        logger.info("serving model %s (API key %s)", bridge.engine.model_name, "required" if api_key else "off")
        try:
            yield
        finally:
            bridge.call(lambda eng: eng.stats.observers.remove(metrics.observer) if metrics.observer in eng.stats.observers else None)
            if owns:
                bridge.stop()

    app = FastAPI(title="specfw", version=_version(), lifespan=lifespan)
    app.state.specfw = state
    errors.install(app)
    app.include_router(openai_router)
    app.include_router(native_router)
    app.include_router(router_api_router)

    @app.get("/health")
    async def health():
        if not bridge.alive:
            return APIError(503, "engine thread is not running", None, "engine_down").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            e = bridge.engine
            app.openapi_schema = build_openapi(app, vocab_size=e.runner.vocab_size, max_queued=e.scheduler.max_queued, secured=bool(api_key))
        return app.openapi_schema

    app.openapi = openapi

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, on_reject=lambda path: metrics.on_error(path, 413))
    return app


def api_key_from(server_cfg) -> str | None:
    """``server.api_key``, else the ``SPECFW_API_KEY`` environment variable, else no key."""
    return server_cfg.api_key or os.environ.get(API_KEY_ENV) or None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specfw")
    except Exception:  # noqa: BLE001
        return "0"


def run_server(cfg) -> None:
    """``specfw serve``: build the engine from ``cfg`` and serve it with uvicorn on
    ``cfg.server.host:cfg.server.port``. Logging goes through the root logger configured by
    ``cli.setup_logging`` (engine "Prefill batch"/"Decode batch" lines and uvicorn's access log)."""
    import uvicorn

    t0 = time.perf_counter()
    bridge = AsyncEngine.build(lambda: Engine(cfg))  # all torch work on the engine thread (see build)
    app = create_app(bridge, api_key=api_key_from(cfg.server), owns=True, max_request_bytes=int(cfg.server.max_request_bytes))
    logger.info("engine built in %.1f s; listening on http://%s:%d", time.perf_counter() - t0, cfg.server.host, cfg.server.port)
    config = uvicorn.Config(
        app,
        host=cfg.server.host,
        port=int(cfg.server.port),
        log_config=None,
        log_level=str(cfg.server.log_level).lower(),
        access_log=True,
        timeout_graceful_shutdown=5,
    )
    try:
        _Server(config, bridge).run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its clean shutdown
        pass
    logger.info("specfw serve stopped")


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """On Ctrl-C / SIGTERM, end in-flight requests first (503 "Server is shutting down", also
        mid-stream) so uvicorn's graceful shutdown finds no open connection to wait for or cancel."""

        def __init__(self, config, bridge: AsyncEngine):
            super().__init__(config)
            self.bridge = bridge

        def handle_exit(self, sig, frame) -> None:
            self.bridge.request_stop()
            super().handle_exit(sig, frame)

    return Server


def _Server(config, bridge):  # noqa: N802 - a class built lazily (uvicorn is imported only to serve)
    return _uvicorn_server_class()(config, bridge)


__all__ = ["create_app", "run_server", "api_key_from", "APIKeyMiddleware"]
