"""``/openapi.json``: FastAPI's request schemas completed into a description of what the server
really does.

* responses: the 200 body of every route (``schemas.py``; ``application/json``, and
  ``text/event-stream`` for the generation routes), and the errors each route can return, all with
  the OpenAI error body; FastAPI's 422 is dropped (validation errors are 400s);
* ``/metrics`` is ``text/plain`` (Prometheus exposition format);
* per-app limits: token ids at most ``vocab_size - 1``, ``n`` at most ``MAX_N`` or the queue bound;
* the bearer security scheme on every route but ``/health`` and ``/metrics`` when a key is set.

Limits no JSON Schema can state (prompt tokens + ``max_tokens`` against the context and the KV
pool, ``n`` x prompts against the queue bound) are 400s with code ``context_length_exceeded`` /
``invalid_value``, documented in the 400 response's description.
"""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from . import schemas
from .fields import CHOICES_MARK, MAX_N, TOKEN_ID_MARK

REF = "#/components/schemas/{model}"
OPEN_PATHS = ("/health", "/metrics")

_GENERATION_ERRORS = (400, 404, 413, 500, 503)
# (path, method) → (200 body model, streams, error statuses)
ROUTES: dict[tuple[str, str], tuple[Any, bool, tuple[int, ...]]] = {
    ("/v1/chat/completions", "post"): (schemas.ChatCompletion, True, _GENERATION_ERRORS),
    ("/v1/completions", "post"): (schemas.Completion, True, _GENERATION_ERRORS),
    ("/generate", "post"): (schemas.GenerateResponse, True, (400, 413, 500, 503)),
    ("/v1/models", "get"): (schemas.ModelList, False, ()),
    ("/v1/models/{model}", "get"): (schemas.ModelCard, False, (404,)),
    ("/get_model_info", "get"): (schemas.ModelInfo, False, ()),
    ("/get_server_info", "get"): (schemas.ServerInfo, False, ()),
    ("/health", "get"): (schemas.Health, False, (503,)),
}

# one server-sent event: data is a JSON chunk, an error body, or "[DONE]"
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}

ERROR_TEXT = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, an unsupported parameter "
    "(code unsupported_parameter), invalid Unicode (invalid_unicode), or a prompt + max_tokens that does not "
    "fit the context length or the KV pool (context_length_exceeded)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    413: "Request body larger than server.max_request_bytes",
    500: "The engine failed this request",
    503: "Waiting queue full or server shutting down (see the Retry-After header) / engine thread down",
}


def build_openapi(app, *, vocab_size: int, max_queued: int, secured: bool) -> dict:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    comps = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    error_ref = _component(comps, schemas.ErrorResponse)
    for (path, method), (model, streams, errors) in ROUTES.items():
        op = spec["paths"][path][method]
        content = {"application/json": {"schema": _component(comps, model)}}
        if streams:
            content["text/event-stream"] = {"schema": SSE_EVENT}
        statuses = set(errors) | ({401} if secured and path not in OPEN_PATHS else set())
        op["responses"] = {"200": {"description": "OK", "content": content}}
        for status in sorted(statuses):
            resp = {"description": ERROR_TEXT[status], "content": {"application/json": {"schema": error_ref}}}
            if status == 503:
                resp["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
            op["responses"][str(status)] = resp
        if secured and path not in OPEN_PATHS:
            op["security"] = [{"bearer": []}]
    spec["paths"]["/metrics"]["get"]["responses"] = {"200": {"description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    if secured:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    n_max = min(MAX_N, max_queued) if max_queued else MAX_N
    _patch(spec, {TOKEN_ID_MARK: {"maximum": vocab_size - 1}, CHOICES_MARK: {"maximum": n_max}})
    return spec


def _component(comps: dict, model) -> dict:
    """The schema of ``model`` with its definitions moved into ``components``."""
    schema = TypeAdapter(model).json_schema(ref_template=REF)
    comps.update(schema.pop("$defs", {}))
    name = getattr(model, "__name__", None)
    if name and "properties" in schema:
        comps[name] = schema
        return {"$ref": REF.format(model=name)}
    return schema


def _patch(node, marks: dict) -> None:
    """Replace each marker key (``x-token-id`` ...) by the per-app limits it stands for."""
    if isinstance(node, dict):
        for mark, limits in marks.items():
            if node.pop(mark, False):
                node.update(limits)
        for v in node.values():
            _patch(v, marks)
    elif isinstance(node, list):
        for v in node:
            _patch(v, marks)
