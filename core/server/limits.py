"""``BodyLimitMiddleware``: request bodies over ``server.max_request_bytes`` get 413 before any of
it is parsed. A declared ``Content-Length`` over the limit is answered at once without reading;
a body without one (chunked) is counted as it arrives and refused once it passes the limit."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2 ** 20


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject=None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    def _error(self) -> APIError:
        return APIError(413, f"Request body too large: the limit is {self.max_bytes} bytes "
                        "(server.max_request_bytes)", None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, counted, tracked_send)
        except _TooLarge:
            if not started:
                await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_reject:
            self.on_reject(scope["path"])
        await self._error().response()(scope, receive, send)
