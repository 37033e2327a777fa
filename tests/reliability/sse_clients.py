"""Raw HTTP/1.1 streaming clients (asyncio sockets) for the storm and large-body tests."""

from __future__ import annotations

import asyncio
import json
import time


def request_bytes(path: str, body: dict, key: str | None = None) -> bytes:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data


async def stream(port: int, path: str, body: dict, drop_after: int | None = None, key: str | None = None) -> dict:
    """Send one streaming request; read SSE events until the end, or close the socket after
    ``drop_after`` events. Returns {status, events (parsed JSON), times (arrival of each), dropped}."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(path, body, key))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    events, times, buf, dropped = [], [], b"", False
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            line = raw.split(b"data: ", 1)[-1]
            if line.startswith(b"{"):
                events.append(json.loads(line))
                times.append(time.monotonic())
        if drop_after is not None and len(events) >= drop_after:
            dropped = True
            break
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return {"status": status, "events": events, "times": times, "dropped": dropped}
