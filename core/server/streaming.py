"""Server-sent events and client-disconnect handling.

uvicorn silently drops writes to a closed connection, so a disconnect is only noticed by listening
for ``http.disconnect`` on ``receive``. ``SSEResponse`` streams an async iterator of events while
listening; on disconnect it cancels the iterator (whose ``finally`` aborts the engine requests).
``until_disconnect`` does the same for non-streaming requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("specfw.server")

DONE = "data: [DONE]\n\n"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """ASGI response: ``text/event-stream`` of the strings ``events`` yields."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_disconnect: Callable[[], None] | None = None):
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        stream_task = asyncio.ensure_future(stream())
        watch_task = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected = watch_task.done() and not stream_task.done()
            for t in (stream_task, watch_task):
                t.cancel()
            for t in (stream_task, watch_task):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:
                    logger.exception("error while streaming %s", scope.get("path"))
            if hasattr(self.events, "aclose"):
                await self.events.aclose()
            if disconnected:
                logger.info("client disconnected mid-stream (%s)", scope.get("path"))
                if self.on_disconnect:
                    self.on_disconnect()


async def until_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Await ``work`` unless the client disconnects first (then cancel it, call ``on_disconnect``
    and raise ``ClientDisconnected``). The request body must already have been read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        on_disconnect()
        raise
    finally:
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch_task
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    on_disconnect()
    logger.info("client disconnected before the response (%s)", request.url.path)
    raise ClientDisconnected()
