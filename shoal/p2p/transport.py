"""The seam between a node and the network: open a stream to a peer's protocol, serve one's own.

Engines and services reach peers only through a `Transport` (the node hands theirs out on
`NodeContext`). `Libp2pTransport` runs over hivemind's p2p daemon, as every real node does;
`MemoryTransport` (memory.py) puts several nodes in one event loop, so the protocols' hard cases are
tested in one process with scripted faults. Both carry the same bytes: what rides on a stream is
streams.py's framing, and the RPCs on top are rpc.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from shoal.p2p.streams import FramedStream

StreamHandler = Callable[[FramedStream], Awaitable[None]]


@runtime_checkable
class Transport(Protocol):
    """Streams to peers by protocol name. `open` raises (any exception) when the peer cannot be reached."""

    peer_id: str

    async def open(self, peer: str, protocol: str, timeout_s: float) -> FramedStream: ...

    async def add_handler(self, protocol: str, handler: StreamHandler, timeout_s: float) -> None:
        """Serve `protocol`: each incoming stream goes to `handler` (with its `peer` and `remote_addr`
        set, and closed once the handler returns); its reads wait at most `timeout_s`."""
        ...

    async def remove_handler(self, protocol: str) -> None: ...

    async def connected_peers(self) -> set[str]:
        """The peers this node holds a connection to now."""
        ...


class Libp2pTransport:
    """Streams through the node's libp2p daemon (hivemind's `P2P`)."""

    def __init__(self, p2p: Any, peer_id: str | None = None):
        self.p2p = p2p
        self.peer_id = peer_id if peer_id is not None else p2p.peer_id.to_base58()

    async def open(self, peer: str, protocol: str, timeout_s: float) -> FramedStream:
        from hivemind.p2p import PeerID

        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), timeout_s
        )
        stream = FramedStream(reader, writer, timeout_s)
        stream.peer = peer
        return stream

    async def add_handler(self, protocol: str, handler: StreamHandler, timeout_s: float) -> None:
        async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            stream = FramedStream(reader, writer, timeout_s)
            stream.remote_addr = str(stream_info.addr) if getattr(stream_info, "addr", None) else None
            stream.peer = stream_info.peer_id.to_base58()
            try:
                await handler(stream)
            finally:
                stream.close()

        await self.p2p.add_binary_stream_handler(protocol, handle)

    async def remove_handler(self, protocol: str) -> None:
        await self.p2p.remove_binary_stream_handler(protocol)

    async def connected_peers(self) -> set[str]:
        return {info.peer_id.to_base58() for info in await self.p2p.list_peers()}
