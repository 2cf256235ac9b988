"""The one tiny HTTP responder shoal serves pages with (metrics, the dashboard): GET/HEAD, one
request per connection, bounded by a read timeout, on the caller's own event loop so a request
never reads half-updated state from another thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

REQUEST_TIMEOUT_S = 5.0
Responder = Callable[[str, str], tuple[str, bytes, str]]  # (method, path) -> (status, body, content type)


async def answer_one_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, respond: Responder, headers: str = ""
) -> None:
    """Read one request head, answer it with `respond` (plus `headers`, CRLF-terminated lines), close."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
        status, body, kind = respond(method, path)
        header = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n{headers}"
        writer.write((header + "Connection: close\r\n\r\n").encode("latin-1"))
        if method != "HEAD":
            writer.write(body)
        await writer.drain()
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass  # a client that left, or sent no request within the limits: nothing to answer
    finally:
        writer.close()
