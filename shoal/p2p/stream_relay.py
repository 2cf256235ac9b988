"""Streams to a node behind NAT, carried by one of its relays at shoal's level.

libp2p's circuit relay (relay.py) lets a NAT'd node be dialed, but the bundled p2pd resets each
relayed connection after 128 KiB in either direction (go-libp2p's default relay resources: p2pd
takes `-relayDataLimit` and never applies it). A single hop of a real model is megabytes, so stage
work cannot ride a circuit. It rides this instead: the node behind NAT keeps a direct connection to
each of its relays (the one it opened to reserve its slot), a relay can open streams over that
connection, and so a peer that wants a stream to the node opens one to a relay (`RelayOpen`), the
relay opens one to the node (`RelayedFrom`, naming the peer its own authenticated stream came from)
and copies bytes both ways until either side ends. No limit but the relay's stream count.

Trust: the node believes the origin a relay names only from the relays it chose itself (its own
initial peers first, then nodes that offer relaying); a stranger that sends `RelayedFrom` is refused.
A relay it chose could still lie about the origin; the peers it would impersonate are checked
further up as they are for any sender (signed records, the step window, audits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from shoal.p2p.streams import FramedStream
from shoal.p2p.transport import StreamHandler, Transport
from shoal.protocol.messages import RelayedFrom, RelayOpen
from shoal.protocol.pipeline import Ack

logger = logging.getLogger(__name__)

RELAY_PROTOCOL = "shoal.relay"  # served by relays: carry this stream to a node behind NAT
RELAYED_PROTOCOL = "shoal.relayed"  # served by every node: a stream a relay carries to us
PIPE_CHUNK_BYTES = 1 << 16
PIPE_IDLE_S = 600.0  # a carried stream with no byte either way this long is dropped (kept RPC streams idle less)
MAX_CARRIED = 256  # streams one relay carries at once
RELAY_STREAM_TIMEOUT_S = 30.0  # a bootstrap peer's wait for a stream's header (a node uses its RPC timeout)


class RelayRefused(ConnectionError):
    """A relay would not carry the stream (the node is not connected to it, or it is full)."""


class RelayingTransport:
    """A `Transport` that opens streams to a node behind NAT through the relays its record lists, and
    serves the streams relays carry to us. Nothing changes for a peer with no relays listed.

    `relays_of(peer)`: the relays a peer's record lists; `own_relays()`: ours (whom we believe
    about a stream's origin). The node sets both once it reads the swarm."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.peer_id = inner.peer_id
        self.relays_of: Callable[[str], Sequence[str]] = lambda peer: ()
        self.own_relays: Callable[[], Sequence[str]] = lambda: ()
        self._handlers: dict[str, tuple[StreamHandler, float]] = {}
        self.carried = 0  # streams this node carried as a relay
        self.carried_bytes = 0  # their bytes, both directions
        self._carrying = 0

    async def open(self, peer: str, protocol: str, timeout_s: float) -> FramedStream:
        relays = list(self.relays_of(peer))
        if not relays or self.peer_id in relays:  # dialed directly, or it keeps its connection to us
            return await self.inner.open(peer, protocol, timeout_s)
        failures = []
        for relay in relays:
            try:
                stream = await self.inner.open(relay, RELAY_PROTOCOL, timeout_s)
            except Exception as e:
                failures.append(f"{relay[-8:]}: {type(e).__name__}")
                continue
            try:
                await stream.write_message(RelayOpen(to=peer, protocol=protocol))
                ack = await stream.read_message(Ack, wait_s=timeout_s)
            except Exception as e:
                stream.close()
                failures.append(f"{relay[-8:]}: {type(e).__name__}")
                continue
            if not ack.accepted:
                stream.close()
                failures.append(f"{relay[-8:]}: {ack.reason}")
                continue
            stream.peer = peer
            return stream
        raise RelayRefused(f"no relay carried a stream to {peer[-8:]} ({'; '.join(failures)})")

    async def add_handler(self, protocol: str, handler: StreamHandler, timeout_s: float) -> None:
        self._handlers[protocol] = (handler, timeout_s)
        await self.inner.add_handler(protocol, handler, timeout_s)

    async def remove_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)
        await self.inner.remove_handler(protocol)

    async def connected_peers(self) -> set[str]:
        return await self.inner.connected_peers()

    async def serve_relayed(self, timeout_s: float) -> None:
        """Take the streams our relays carry to us, as if their origin had opened them."""
        await self.inner.add_handler(RELAYED_PROTOCOL, self._relayed, timeout_s)

    async def serve_relay(self, timeout_s: float) -> None:
        """Carry streams to the nodes behind NAT that keep a connection to us."""
        await self.inner.add_handler(RELAY_PROTOCOL, self._relay, timeout_s)

    async def _relayed(self, stream: FramedStream) -> None:
        relay = stream.peer
        if relay not in self.own_relays():
            logger.info("refused a relayed stream from %s: not one of our relays", relay[-8:])
            return
        header = await stream.read_message(RelayedFrom)
        entry = self._handlers.get(header.protocol)
        if entry is None:
            return  # as a direct stream to an unserved protocol: the opener sees the stream end
        handler, timeout_s = entry
        carried = FramedStream(stream.reader, stream.writer, timeout_s)
        carried.peer = header.origin
        await handler(carried)

    async def _relay(self, stream: FramedStream) -> None:
        origin = stream.peer
        request = await stream.read_message(RelayOpen)
        why = await self._refusal(request, origin)
        if why:
            await stream.write_message(Ack(accepted=False, reason=why))
            return
        self._carrying += 1
        try:
            try:
                onward = await self.inner.open(request.to, RELAYED_PROTOCOL, stream.timeout_s)
                await onward.write_message(RelayedFrom(origin=origin, protocol=request.protocol))
            except Exception as e:
                await stream.write_message(Ack(accepted=False, reason=f"cannot reach {request.to[-8:]}: {e!r}"[:200]))
                return
            await stream.write_message(Ack(accepted=True))
            self.carried += 1
            pipes = [asyncio.create_task(self._pipe(stream, onward)), asyncio.create_task(self._pipe(onward, stream))]
            try:  # p2pd's streams do not half-close: one side's end is the stream's
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                onward.close()
        finally:
            self._carrying -= 1

    async def _refusal(self, request: RelayOpen, origin: str) -> str:
        if request.to in (self.peer_id, origin):
            return "not a node behind NAT"
        if self._carrying >= MAX_CARRIED:
            return f"carrying {MAX_CARRIED} streams already"
        if request.to not in await self.inner.connected_peers():
            return f"{request.to[-8:]} keeps no connection to this relay"
        return ""

    async def _pipe(self, source: FramedStream, sink: FramedStream) -> None:
        """Copy bytes until `source` ends or idles PIPE_IDLE_S."""
        try:
            while chunk := await asyncio.wait_for(source.reader.read(PIPE_CHUNK_BYTES), PIPE_IDLE_S):
                sink.writer.write(chunk)
                await sink.writer.drain()
                self.carried_bytes += len(chunk)
        except (TimeoutError, ConnectionError, OSError):
            pass
