"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Status codes: 400 for anything wrong with the request (malformed JSON, wrong types, out-of-range
values, prompts or ``max_tokens`` beyond the context), 401 bad/missing API key, 404 unknown model
or route, 405 wrong method, 413 body over ``server.max_request_bytes``, 500 engine failure, 503
queue full or server shutting down (with ``Retry-After``). Every 4xx carries a ``code``.
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParamsError
from ..scheduler import RequestRejected

logger = logging.getLogger("specfw.server")

RETRY_AFTER_S = 1
_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 503: "unavailable"}
_PYDANTIC_CODES = ("invalid_unicode", "unsupported_parameter")  # our own error types, used as codes
_UNION_TAG_CHARS = set("[]-")
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


class APIError(Exception):
    """An error returned to the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _DEFAULT_CODES.get(status)
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        if status == 503:
            headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while building or running a request to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param, "invalid_value")
    if isinstance(exc, RequestRejected):
        if exc.param == "queue":
            return APIError(503, f"Server overloaded: {exc}", None, "queue_full")
        code = "context_length_exceeded" if "context length" in str(exc) or "KV pool" in str(exc) else "invalid_value"
        return APIError(400, str(exc), exc.param, code)
    try:
        from jinja2 import TemplateError

        if isinstance(exc, TemplateError):
            return APIError(400, f"chat template error: {exc}", "messages", "invalid_value")
    except ImportError:  # pragma: no cover
        pass
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}", None, "internal_error")


def _param_from_loc(loc) -> str | None:
    """``('body', 'prompt', 'list[int]', 0)`` → ``prompt.0`` (pydantic's union member tags dropped)."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p == "body" or _UNION_TAG_CHARS & set(p) or p in ("str", "int", "float", "bool")))]
    return ".".join(parts) or None


def _respond(request: Request, err: APIError) -> JSONResponse:
    state = getattr(request.app.state, "specfw", None)
    if state is not None:
        state.metrics.on_error(request.url.path, err.status)
    if err.status >= 500:
        logger.error("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
    return err.response()


async def validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    # our own error types say most, then the deepest error (a union reports one per member)
    e = max(errs, key=lambda x: (x.get("type") in _PYDANTIC_CODES, len(x.get("loc", ())))) if errs else {"msg": "invalid request", "loc": (), "type": ""}
    if e.get("type") == "json_invalid":
        return _respond(request, bad_request(f"Invalid JSON body: {e.get('msg')}", None, "invalid_json"))
    param = _param_from_loc(e.get("loc", ()))
    if param is None and e.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return _respond(request, bad_request("The request body must be a JSON object (Content-Type: application/json)", None, "invalid_json"))
    msg = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})"
    code = e.get("type") if e.get("type") in _PYDANTIC_CODES else "invalid_value"
    return _respond(request, bad_request(msg, param, code))


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """APIError, SamplingParamsError, RequestRejected."""
    return _respond(request, to_api_error(exc))


async def http_exception_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    code = None
    if exc.status_code == 404:
        msg = f"Not found: {request.method} {request.url.path!r}"
    elif exc.status_code == 400:  # the body could not be read as JSON (e.g. invalid UTF-8)
        msg, code = f"Invalid JSON body: {msg}", "invalid_json"
    return _respond(request, APIError(exc.status_code, msg, None, code, headers=getattr(exc, "headers", None)))


async def unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return _respond(request, to_api_error(exc))


def install(app) -> None:
    app.add_exception_handler(RequestValidationError, validation_handler)
    for cls in (APIError, SamplingParamsError, RequestRejected):
        app.add_exception_handler(cls, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, unhandled_handler)
