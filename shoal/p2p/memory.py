"""Several nodes in one event loop: streams as in-memory pipes, with faults a test scripts.

What travels is the same as over libp2p (streams.py's frames, rpc.py's messages, checked by the same
decoders); only the daemons and sockets are gone. A test builds a `MemoryNetwork`, gives each node a
`transport(peer_id)`, and then kills a peer (its handlers stop, every stream it had breaks, nobody can
open one to it), which is what a SIGKILL looks like from the other side. `before_open` lets a test
act at the moment one node opens a stream to another (kill the receiver mid-forward, say).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.p2p.streams import FramedStream
from shoal.p2p.transport import StreamHandler

OpenHook = Callable[[str, str, str], Awaitable[None] | None]  # (caller, callee, protocol)


class PeerUnreachable(ConnectionError):
    """No stream to a peer that is down or does not serve the protocol (libp2p's dial or negotiation failing)."""


class _PipeTransport(asyncio.Transport):
    """The write end of one direction of a pipe: what it is given lands in the other end's reader."""

    def __init__(self, peer_reader: asyncio.StreamReader):
        super().__init__()
        self.peer_reader = peer_reader
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            raise ConnectionResetError("the stream is closed")
        if not self.peer_reader.at_eof():
            self.peer_reader.feed_data(bytes(data))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.peer_reader.at_eof():
                self.peer_reader.feed_eof()

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Protocol(asyncio.streams.FlowControlMixin):
    pass


def _end(peer_reader: asyncio.StreamReader) -> tuple[asyncio.StreamWriter, _PipeTransport]:
    transport = _PipeTransport(peer_reader)
    own_reader = asyncio.StreamReader()
    writer = asyncio.StreamWriter(transport, _Protocol(), own_reader, asyncio.get_running_loop())
    return writer, transport


class MemoryNetwork:
    """The peers of one test and the streams between them."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, tuple[StreamHandler, float]]] = {}
        self.down: set[str] = set()
        self.before_open: OpenHook | None = None
        self.opened: list[tuple[str, str, str]] = []  # (caller, callee, protocol), in order
        self._pipes: dict[str, list[_PipeTransport]] = {}
        self._tasks: dict[str, set[asyncio.Task]] = {}

    def transport(self, peer_id: str) -> MemoryTransport:
        self.handlers.setdefault(peer_id, {})
        self.down.discard(peer_id)
        return MemoryTransport(self, peer_id)

    def kill(self, peer_id: str) -> None:
        """The peer is gone: its handlers and the work they were doing stop, its streams break."""
        self.down.add(peer_id)
        self.handlers[peer_id] = {}
        for pipe in self._pipes.pop(peer_id, []):
            pipe.close()
        for task in self._tasks.pop(peer_id, set()):
            task.cancel()

    async def open(self, caller: str, callee: str, protocol: str, timeout_s: float) -> FramedStream:
        if caller in self.down:
            raise PeerUnreachable(f"{caller[-8:]} is down")
        if self.before_open is not None:
            acted = self.before_open(caller, callee, protocol)
            if acted is not None:
                await acted
        served = self.handlers.get(callee, {}).get(protocol)
        if callee == caller:
            raise PeerUnreachable(f"{caller[-8:]} dials itself")  # as libp2p, which refuses to
        if callee in self.down or served is None:
            raise PeerUnreachable(f"{callee[-8:]} does not answer {protocol}")
        handler, serve_timeout_s = served
        self.opened.append((caller, callee, protocol))
        client_in, server_in = asyncio.StreamReader(), asyncio.StreamReader()
        client_writer, client_pipe = _end(server_in)
        server_writer, server_pipe = _end(client_in)
        for peer, pipe in ((caller, client_pipe), (callee, server_pipe), (caller, server_pipe), (callee, client_pipe)):
            self._pipes.setdefault(peer, []).append(pipe)
        client = FramedStream(client_in, client_writer, timeout_s)
        client.peer = callee
        server = FramedStream(server_in, server_writer, serve_timeout_s)
        server.peer, server.remote_addr = caller, f"/memory/{caller}"
        task = asyncio.ensure_future(self._serve(handler, server))
        self._tasks.setdefault(callee, set()).add(task)
        task.add_done_callback(self._tasks[callee].discard)
        return client

    @staticmethod
    async def _serve(handler: StreamHandler, stream: FramedStream) -> None:
        try:
            await handler(stream)
        finally:
            stream.close()


class MemoryTransport:
    """One node's end of a `MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, peer_id: str):
        self.network, self.peer_id = network, peer_id

    async def open(self, peer: str, protocol: str, timeout_s: float) -> FramedStream:
        return await self.network.open(self.peer_id, peer, protocol, timeout_s)

    async def add_handler(self, protocol: str, handler: StreamHandler, timeout_s: float) -> None:
        self.network.handlers.setdefault(self.peer_id, {})[protocol] = (handler, timeout_s)

    async def remove_handler(self, protocol: str) -> None:
        self.network.handlers.get(self.peer_id, {}).pop(protocol, None)

    async def connected_peers(self) -> set[str]:
        return {peer for peer in self.network.handlers if peer != self.peer_id and peer not in self.network.down}
