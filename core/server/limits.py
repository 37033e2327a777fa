"""``BodyLimitMiddleware``: request bodies over ``server.max_request_bytes`` get 413 before any of
it is parsed. A declared ``Content-Length`` over the limit is answered at once without reading;
a body without one (chunked) is read here first, and refused as soon as it passes the limit."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2 ** 20


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject=None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) <= self.max_bytes:
                await self.app(scope, receive, send)     # the server reads exactly that many bytes
            else:
                await self._reject(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)
            return
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_reject:
            self.on_reject(scope["path"])
        err = APIError(413, f"Request body too large: the limit is {self.max_bytes} bytes (server.max_request_bytes)",
                       None, "request_too_large", headers={"Connection": "close"})
        await err.response()(scope, receive, send)
