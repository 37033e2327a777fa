"""``BodyLimitMiddleware``: request bodies over ``server.max_request_bytes`` get 413 before any of
it is parsed. A declared ``Content-Length`` over the limit is answered at once without reading;
a body without one (chunked) is read here first, and refused as soon as it passes the limit.

After the 413 is sent, the rest of the body is read and dropped (up to ``DRAIN_FACTOR`` times the
limit): a socket closed with unread data in its receive buffer sends a TCP reset, and a client
still writing its body would see "connection reset" instead of the 413. Bodies beyond that bound
are not read; their connection is closed at once."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DRAIN_FACTOR = 8  # a refused body is read and dropped up to this many times the limit


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
                await self.app(scope, receive, send)  # the server reads exactly that many bytes
            else:
                await self._reject(scope, receive, send, int(length))
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
                await self._reject(scope, receive, send, None if message.get("more_body", False) else 0, seen)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, declared: int | None, seen: int = 0) -> None:
        """Send the 413, then drop the rest of the body: ``declared`` bytes in all (None: unknown,
        chunked), ``seen`` of them read already; nothing more when it exceeds the drain bound."""
        if self.on_reject:
            self.on_reject(scope["path"])
        bound = DRAIN_FACTOR * self.max_bytes
        drain = declared != 0 and (declared is None or declared <= bound)
        # without "Connection: close" while draining: the server would close the socket right after
        # the response, before the rest of the body is read
        err = APIError(
            413,
            f"Request body too large: the limit is {self.max_bytes} bytes (server.max_request_bytes)",
            None,
            "request_too_large",
            headers={} if drain else {"Connection": "close"},
        )
        await err.response()(scope, receive, send)
        if not drain:
            return
        while seen <= bound:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))
