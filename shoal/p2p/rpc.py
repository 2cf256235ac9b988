"""Typed RPCs: each declared once, with its request and reply types; callers and servers both derive
from the declaration, so no RPC is ever named by a string.

    class NodeRpcs(Service):
        ping = Rpc(Ping, Pong)

    pong = await NodeRpcs(transport).ping(peer, Ping(...), timeout_s=2.0)        # a caller
    await serve(transport, NodeRpcs, {NodeRpcs.ping: answer_ping})                # a server

A `Service` subclass is both the declaration (`NodeRpcs.ping` is the `Rpc`) and, instantiated over a
transport, the caller's stub (`NodeRpcs(transport).ping` is a `BoundRpc`). A unary RPC's handler takes
`(request, sender)`; a streamed one's `(request, stream, sender)`, for tensors that follow the request
or the reply. Every failure a handler meets becomes an `ErrorReply` for the caller, never a dead daemon.

The pipeline's hops and step closes (`Rpc.keep_alive`) keep their stream: after an accepted reply
the server reads the next request on it, and the caller puts it in its `StreamPool` for the next call
to the same peer. Opening a libp2p stream costs a round trip through both daemons and a protocol
negotiation, about a tenth of a 1 MiB hop on loopback. Only an accepted exchange leaves a stream
reusable (both ends then know every byte was read); anything else closes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from shoal.p2p.streams import EndOfStream, FramedStream, RemoteError, read_reply
from shoal.p2p.transport import Transport
from shoal.protocol.errors import ProtocolError
from shoal.protocol.limits import CHUNK_BYTES
from shoal.protocol.messages import ErrorReply

logger = logging.getLogger(__name__)

PROTOCOL_PREFIX = "shoal.rpc_"  # a declared RPC `forward` is served as the stream protocol `shoal.rpc_forward`
POOL_IDLE_S = 20.0  # a caller reuses a kept stream idle at most this long
SERVE_IDLE_S = 60.0  # a server waits this long for the next request on a kept stream (> POOL_IDLE_S)
POOL_PER_KEY = 4  # idle streams kept per (peer, rpc)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, eq=False)
class Rpc(Generic[Req, Rep]):
    """One RPC: what it takes and answers. Its name is the attribute it is declared as."""

    request: type[Req]
    reply: type[Rep]
    streamed: bool = False  # the handler gets the stream: tensors follow the request or the reply
    keep_alive: bool = False  # the hot path: a stream serves many calls (see the module docstring)
    refusal: str = "not served here"  # a node's answer while nothing it runs serves this RPC
    name: str = field(default="", init=False)

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "name", name)

    @property
    def protocol(self) -> str:
        return PROTOCOL_PREFIX + self.name

    @overload
    def __get__(self, stub: None, owner: type) -> Rpc[Req, Rep]: ...

    @overload
    def __get__(self, stub: Service, owner: type) -> BoundRpc[Req, Rep]: ...

    def __get__(self, stub: Service | None, owner: type) -> Rpc[Req, Rep] | BoundRpc[Req, Rep]:
        return self if stub is None else BoundRpc(self, stub.transport, stub.pool)

    def __repr__(self) -> str:
        return f"Rpc({self.name}: {self.request.__name__} -> {self.reply.__name__})"


class Service:
    """A set of RPCs (declared as `Rpc` class attributes); an instance is a caller's stub over a transport."""

    def __init__(self, transport: Transport, pool: StreamPool | None = None):
        self.transport = transport
        self.pool = pool  # kept streams for the `keep_alive` RPCs (None: a fresh stream per call)

    @classmethod
    def rpcs(cls) -> dict[str, Rpc]:
        found: dict[str, Rpc] = {}
        for klass in reversed(cls.__mro__):
            found |= {name: value for name, value in vars(klass).items() if isinstance(value, Rpc)}
        return found


class BoundRpc(Generic[Req, Rep]):
    """A declared RPC on a caller's transport: `await bound(peer, request)`, or `open` a stream for a
    streamed call."""

    def __init__(self, rpc: Rpc[Req, Rep], transport: Transport, pool: StreamPool | None):
        self.rpc, self.transport, self.pool = rpc, transport, pool

    async def open(self, peer: str, timeout_s: float) -> FramedStream:
        return await self.transport.open(peer, self.rpc.protocol, timeout_s)

    async def __call__(self, peer: str, request: Req, timeout_s: float = 10.0) -> Rep:
        """A unary call: one request, one reply (`RemoteError` if the peer answered an error). On a kept
        stream when the RPC keeps them and the stub has a pool."""
        if self.rpc.keep_alive and self.pool is not None:
            return await self._pooled(peer, request, timeout_s)
        stream = await self.open(peer, timeout_s)
        try:
            await stream.write_message(request)
            return await read_reply(stream, self.rpc.reply)
        finally:
            stream.close()

    async def _pooled(self, peer: str, request: Req, timeout_s: float) -> Rep:
        """A kept stream found dead (it ended or broke) is replaced by a fresh one at once, so the peer may
        get the request twice: such an rpc must take a repeat as already done. A reply that does not come
        in time is not retried: the peer has the request and is still at it."""
        assert self.pool is not None
        for fresh in (False, True):
            stream, kept = await self.pool.take(peer, self.rpc, timeout_s, fresh=fresh)
            try:
                await stream.write_message(request)
                reply = await read_reply(stream, self.rpc.reply)
            except (RemoteError, TimeoutError):  # an answer, or none in time: a live stream, nothing to retry
                stream.close()
                raise
            except Exception:
                stream.close()
                if kept:
                    self.pool.found_dead += 1
                    continue
                raise
            if getattr(reply, "accepted", False) is True:
                self.pool.give_back(peer, self.rpc, stream)
            else:
                stream.close()
            return reply
        raise AssertionError("unreachable: the fresh stream's outcome is returned or raised")


class StreamPool:
    """A caller's idle kept streams (`Rpc.keep_alive`), per (peer, rpc), for the next call to reuse.

    `take` hands out an idle stream if one is fit (most recently used first) or opens a new one; after
    an accepted exchange the caller `give_back`s it, after anything else it closes it. A kept stream
    can still turn out dead on use (the peer restarted, or closed it while idle): the caller retries
    once on a fresh stream, which receivers already take as a repeat of a request they may have run.
    """

    def __init__(self, transport: Transport, per_key: int = POOL_PER_KEY, idle_s: float = POOL_IDLE_S):
        self.transport, self.per_key, self.idle_s = transport, per_key, idle_s
        self._idle: dict[tuple[str, str], list[tuple[float, FramedStream]]] = {}
        self.opened = 0
        self.opened_by_rpc: Counter[str] = Counter()
        self.reused = 0
        self.found_dead = 0  # kept streams that failed on use (the caller replaced them with a fresh one)

    async def take(self, peer: str, rpc: Rpc, timeout_s: float, fresh: bool = False) -> tuple[FramedStream, bool]:
        """(a stream to `peer`'s `rpc`, whether it was kept from an earlier call)."""
        idle = self._idle.get((peer, rpc.name), [])
        now = asyncio.get_running_loop().time()
        while idle and not fresh:
            since, stream = idle.pop()
            if now - since <= self.idle_s and stream.reusable:
                stream.timeout_s = timeout_s
                self.reused += 1
                return stream, True
            stream.close()
        stream = await self.transport.open(peer, rpc.protocol, timeout_s)
        self.opened += 1
        self.opened_by_rpc[rpc.name] += 1
        return stream, False

    def give_back(self, peer: str, rpc: Rpc, stream: FramedStream) -> None:
        idle = self._idle.setdefault((peer, rpc.name), [])
        if len(idle) >= self.per_key or not stream.reusable:
            stream.close()
            return
        idle.append((asyncio.get_running_loop().time(), stream))

    def close(self) -> None:
        for idle in self._idle.values():
            for _, stream in idle:
                stream.close()
        self._idle.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "streams_opened": self.opened,
            "streams_opened_by_rpc": dict(self.opened_by_rpc),
            "streams_reused": self.reused,
            "kept_streams_dead": self.found_dead,
        }


Handlers = Mapping[Rpc, Handler]


async def serve(
    transport: Transport,
    service: type[Service],
    handlers: Handlers | Callable[[], Handlers],
    *,
    timeout_s: float = 30.0,
    errors: Counter[str] | None = None,
    who: str = "",
    heard: Callable[[str], Any] | None = None,
    refuse: Callable[[Rpc], Any] | None = None,
) -> list[str]:
    """Serve `service`'s RPCs, each by its handler in `handlers`: a mapping (the RPCs it has handlers
    for), or a function returning the current one (every RPC declared: a node's engine changes, and an
    RPC with no handler now is answered `refuse(rpc)`, by default an error). `heard(peer_id)` runs on
    every call: a peer that asks us something is alive (suspects.py). Failed requests are counted by
    kind in `errors` (rpc_refused, rpc_stream_failed, rpc_internal); `who` (the node's short peer id)
    prefixes their log lines.
    Returns the protocols served, for `unserve`."""
    current = handlers if callable(handlers) else (lambda: handlers)
    errors = Counter() if errors is None else errors
    served = []
    declared = service.rpcs().values()
    for rpc in declared if callable(handlers) else [rpc for rpc in declared if rpc in handlers]:
        dispatch = _Dispatcher(rpc, current, errors, who, heard, refuse)
        await transport.add_handler(rpc.protocol, dispatch.handle, timeout_s)
        served.append(rpc.protocol)
    return served


async def unserve(transport: Transport, protocols: list[str]) -> None:
    for protocol in protocols:
        try:
            await transport.remove_handler(protocol)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove handler %s: %s", protocol, e)


class _Dispatcher:
    """One served RPC: read each request, hand it to the current handler, write the reply."""

    def __init__(self, rpc: Rpc, handlers: Callable[[], Handlers], errors: Counter[str], who: str,
                 heard: Callable[[str], Any] | None, refuse: Callable[[Rpc], Any] | None):  # fmt: skip
        self.rpc, self.handlers, self.errors, self.who = rpc, handlers, errors, who
        self.heard, self.refuse = heard, refuse

    async def handle(self, stream: FramedStream) -> None:
        wait_s = None  # the first request is due at once; later ones on a kept stream may wait
        while await self._serve_one(stream, wait_s):
            wait_s = SERVE_IDLE_S

    async def _answer(self, request: Any, stream: FramedStream) -> Any:
        if self.heard is not None:
            self.heard(stream.peer)
        handler = self.handlers().get(self.rpc)
        if handler is None:
            if self.refuse is None:
                raise LookupError(f"{self.rpc.name} has no handler")
            return self.refuse(self.rpc)
        if self.rpc.streamed:
            return await handler(request, stream, stream.peer)
        return await handler(request, stream.peer)

    async def _serve_one(self, stream: FramedStream, wait_s: float | None) -> bool:
        """Answer one request; True when the stream is clean for another (an accepted reply)."""
        name, peer = self.rpc.name, stream.peer
        try:
            request = await stream.read_message(self.rpc.request, wait_s)
            reply = await self._answer(request, stream)
            if reply is not None:
                await stream.write_message(reply)
            if self.rpc.keep_alive and getattr(reply, "accepted", False) is True:
                return True
            await _discard_unread(stream)
        except EndOfStream:
            pass
        except ProtocolError as e:
            self.errors["rpc_refused"] += 1
            logger.warning("[%s] %s from %s refused: %s", self.who, name, peer, e)
            await _try_reply(stream, ErrorReply.from_error(e))
            await _discard_unread(stream)
        except (TimeoutError, ConnectionError) as e:
            self.errors["rpc_stream_failed"] += 1
            logger.info("[%s] %s from %s: stream failed (%s)", self.who, name, peer, type(e).__name__)
        except Exception as e:
            self.errors["rpc_internal"] += 1
            logger.exception("[%s] %s from %s failed", self.who, name, peer)
            await _try_reply(stream, ErrorReply(code="internal", message=f"{type(e).__name__}"[:200]))
        return False


async def _try_reply(stream: FramedStream, reply: ErrorReply) -> None:
    try:
        await stream.write_message(reply)
    except Exception as e:
        logger.debug("could not send the error reply: %s", e)


async def _discard_unread(stream: FramedStream, max_bytes: int = 2 * CHUNK_BYTES, timeout_s: float = 1.0) -> None:
    """Read away (a bounded amount of) what the peer is still sending, so that closing the stream
    does not reset it before our reply reaches the peer (an error, or a refusal made before the
    tensor that followed the request was read)."""
    loop = asyncio.get_running_loop()
    deadline, discarded = loop.time() + timeout_s, 0
    try:
        while discarded < max_bytes and (remaining := deadline - loop.time()) > 0:
            data = await asyncio.wait_for(stream.reader.read(65536), remaining)
            if not data:
                return
            discarded += len(data)
    except (TimeoutError, ConnectionError):
        pass
