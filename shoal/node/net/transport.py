"""Framed request/response over libp2p binary streams.

A frame is a 4-byte big-endian length and that many bytes. A call opens one stream, sends a
request message (and, for pipeline calls, tensors as a header frame plus raw chunk frames), and
reads the reply. Every read has a deadline and a size bound checked before the payload is read,
and every failure a handler meets becomes an `ErrorReply` for the caller, never a dead daemon.

The pipeline's hops and step closes (`KEEP_ALIVE_RPCS`) keep their stream: after an accepted reply
the server reads the next request on it, and the caller puts it in its `StreamPool` for the next
call to the same peer. Opening a libp2p stream costs a round trip through both daemons and a
protocol negotiation, about a tenth of a 1 MiB hop on loopback. Only an accepted exchange leaves a stream reusable (both
ends then know every byte was read); anything else closes it, as before.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import typing
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID

from shoal.protocol.codec import decode, encode
from shoal.protocol.errors import MalformedMessage, MessageTooLarge, ProtocolError
from shoal.protocol.limits import CHUNK_BYTES, MAX_MESSAGE_BYTES
from shoal.protocol.messages import ErrorReply
from shoal.protocol.tensors import QUANTIZED_DTYPES, TensorAssembler, TensorHeader, TensorSpec

from . import shaper

logger = logging.getLogger(__name__)

FRAME_LENGTH_BYTES = 4
MAX_FRAME_BYTES = max(MAX_MESSAGE_BYTES, CHUNK_BYTES)
HANDLER_PREFIX = "shoal."
# the hot path: a stream serves many hops, and a data node's step closes (one per step and worker)
KEEP_ALIVE_RPCS = frozenset({"rpc_forward", "rpc_backward", "rpc_step_close"})
POOL_IDLE_S = 20.0  # a caller reuses a kept stream idle at most this long
SERVE_IDLE_S = 60.0  # a server waits this long for the next request on a kept stream (> POOL_IDLE_S)
POOL_PER_KEY = 4  # idle streams kept per (peer, rpc)
# Our end of each stream's unix socket to the local p2p daemon: room for a whole hop (request, header
# and a 2 MiB chunk) in one write. The default (208 KiB here) takes a 256 KiB activation in two
# writes with a wait for the daemon to read in between. The kernel caps it at net.core.wmem_max.
SEND_BUFFER_BYTES = 4 * 2**20


WIRE_KINDS = ("activation", "gradient", "outer", "copy", "audit", "control")


class WireBytes:
    """Bytes this process wrote to its streams, by kind: activations and their gradients between stages, outer
    exchanges between replicas, stage copies to joiners, step transcripts for data nodes' step audits, and
    control (every other message). Frame lengths count; a hop's request, written with its tensor, counts with
    the tensor. The DHT's own traffic runs inside the p2p daemon and is not seen here."""

    def __init__(self) -> None:
        self.sent = dict.fromkeys(WIRE_KINDS, 0)

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += nbytes

    def counts(self) -> dict[str, int]:
        return dict(self.sent)


WIRE_BYTES = WireBytes()


class EndOfStream(Exception):
    """A kept stream ended, or stayed idle, between two requests: a normal close, not an error."""


class RemoteError(Exception):
    """The peer answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"{code}: {message}")


class FramedStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float):
        self.reader, self.writer, self.timeout_s = reader, writer, timeout_s
        self.remote_addr: str | None = None  # served streams: the multiaddr the caller's connection came from
        self.peer = ""  # the remote peer id: the link an experiment's shaper queues our sends on (shaper.py)
        _widen_send_buffer(writer)

    async def read_frame(self, max_bytes: int = MAX_FRAME_BYTES, wait_s: float | None = None) -> bytes:
        """One frame. With `wait_s` (a kept stream between requests), the frame may take that long to
        begin, and the stream ending or staying idle before it begins raises `EndOfStream`."""
        first = b"" if wait_s is None else await self._first_byte(wait_s)
        try:
            async with asyncio.timeout(self.timeout_s):  # a deadline, not a task per read (wait_for's)
                header = first + await self.reader.readexactly(FRAME_LENGTH_BYTES - len(first))
                length = int.from_bytes(header, "big")
                if length > max_bytes:
                    raise MessageTooLarge(f"frame of {length} bytes, over the limit of {max_bytes}")
                return await self.reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise MalformedMessage(f"stream ended inside a frame ({len(e.partial)} bytes read)") from None

    async def _first_byte(self, wait_s: float) -> bytes:
        try:
            async with asyncio.timeout(wait_s):
                first = await self.reader.read(1)
        except TimeoutError:
            raise EndOfStream("idle") from None
        if not first:
            raise EndOfStream("closed by the peer")
        return first

    async def write_frames(
        self, frames: Sequence[bytes | memoryview], starts_message: bool = True, kind: str = "control"
    ) -> None:
        """Frames in one vectored write: a hop's request, tensor header and activation reach the local
        p2p daemon as one piece, where separate writes cost a system call each here and a read, a
        stream frame and an encryption each in both daemons (six of each per hop, not one).
        `starts_message` False: the rest of a tensor whose first chunk went before (a shaped link
        charges its latency once)."""
        parts: list[bytes | memoryview] = []
        for frame in frames:
            parts += [len(frame).to_bytes(FRAME_LENGTH_BYTES, "big"), frame]
        nbytes = sum(len(p) for p in parts)
        WIRE_BYTES.add(kind, nbytes)
        link = shaper.current()
        if link is not None:
            await link.before_send(self.peer, nbytes, starts_message)
        self.writer.writelines(parts)
        if self.writer.transport.get_write_buffer_size() == 0:
            await self.writer.drain()  # all written: nothing to wait for, only a lost connection to report
            return
        async with asyncio.timeout(self.timeout_s):
            await self.writer.drain()

    async def write_frame(self, data: bytes | memoryview) -> None:
        await self.write_frames((data,))

    async def read_message(self, expected: type | tuple[type, ...] | None = None, wait_s: float | None = None) -> Any:
        return decode(await self.read_frame(MAX_MESSAGE_BYTES, wait_s), expected)

    async def write_message(self, message: object) -> None:
        await self.write_frames((encode(message),))

    async def write_tensor(
        self, tensor: Any, wire_dtype: str, leading: Sequence[object] = (), kind: str = "activation"
    ) -> int:
        """Send a torch tensor as a header frame and raw chunk frames, after the `leading` messages and
        in the same write as its first chunk; returns the tensor's bytes. Each further chunk is a write
        of its own, with the stream's deadline for each."""
        from shoal.device import to_host
        from shoal.protocol.torch_tensors import TORCH_DTYPES, quantize_rows

        if wire_dtype in QUANTIZED_DTYPES:  # int8 rows: the scales, then the values (torch_tensors.py)
            scales, values = quantize_rows(tensor)
            sent = await self._write_frames_of(to_host(scales), "float32", leading, kind=kind)
            return sent + await self._write_frames_of(to_host(values), wire_dtype, (), False, kind)
        if tensor.device.type != "cpu" and wire_dtype in TORCH_DTYPES:  # cast on the device: fewer bytes to copy
            tensor = to_host(tensor.detach().to(TORCH_DTYPES[wire_dtype]))
        return await self._write_frames_of(tensor, wire_dtype, leading, kind=kind)

    async def _write_frames_of(
        self,
        tensor: Any,
        wire_dtype: str,
        leading: Sequence[object],
        starts_message: bool = True,
        kind: str = "activation",
    ) -> int:
        from shoal.protocol.torch_tensors import tensor_to_frames

        header, chunks = tensor_to_frames(tensor, wire_dtype)
        await self.write_frames([*(encode(m) for m in leading), encode(header), *chunks[:1]], starts_message, kind)
        for chunk in chunks[1:]:
            await self.write_frames((chunk,), False, kind)
        return header.nbytes

    async def write_exact(self, tensor: Any, wire_dtype: str, kind: str = "outer") -> int:
        """Send a tensor in `wire_dtype` as a plain dtype (int8 values included, never the int8-rows
        codec): for pieces a codec has already made (shoal/train/outer_codec.py). Returns its bytes."""
        from shoal.device import to_host

        return await self._write_frames_of(to_host(tensor), wire_dtype, (), kind=kind)

    async def read_exact(self, spec: TensorSpec, max_bytes: int | None = None, device: Any = None) -> Any:
        """Receive one tensor sent by `write_exact`, checked against `spec`, in its wire dtype."""
        return await self._read_one(spec, None, max_bytes, device)

    async def read_tensor(
        self, spec: TensorSpec, compute_dtype: Any = None, max_bytes: int | None = None, device: Any = None
    ) -> Any:
        """Receive one tensor, checked against `spec`, its declared size and finiteness, onto `device`
        (default: host memory)."""
        import torch

        from shoal.protocol.torch_tensors import rows_scale_spec, rows_to_tensor, rows_values_spec

        if spec.dtype in QUANTIZED_DTYPES:
            scales = await self._read_one(rows_scale_spec(spec), None, max_bytes)
            values = await self._read_one(rows_values_spec(spec, scales), torch.int8, max_bytes)
            return rows_to_tensor(scales, values, compute_dtype or torch.float32, device)
        return await self._read_one(spec, compute_dtype or torch.float32, max_bytes, device)

    async def _read_one(self, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any = None) -> Any:
        from shoal.protocol.torch_tensors import frames_to_tensor

        assembler = TensorAssembler(spec) if max_bytes is None else TensorAssembler(spec, max_bytes=max_bytes)
        header = await self.read_message(TensorHeader)
        assembler.begin(header)
        while not assembler.done:
            assembler.add(await self.read_frame(CHUNK_BYTES))
        payload = assembler.finish()
        return frames_to_tensor(header.meta, payload, spec, compute_dtype=compute_dtype, device=device)

    @property
    def reusable(self) -> bool:
        """Nothing unread and not ended by the peer: fit to carry the next request."""
        return not self.writer.is_closing() and not self.reader.at_eof() and not self.reader._buffer  # type: ignore[attr-defined]

    def close(self) -> None:
        self.writer.close()


def _widen_send_buffer(writer: asyncio.StreamWriter | None) -> None:
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None:
        return
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < SEND_BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    except OSError as e:  # not a socket that takes it: the default buffer only costs a write more
        logger.debug("could not widen a stream's send buffer: %s", e)


Handler = Callable[[Any, FramedStream, PeerID], Awaitable[Any]]


def rpc_methods(service: object) -> dict[str, tuple[Handler, type]]:
    """The service's `rpc_*` methods and the request type each one's first argument declares."""
    methods = {}
    for name, method in inspect.getmembers(service, inspect.ismethod):
        if name.startswith("rpc_"):
            hints = typing.get_type_hints(method)
            request_type = hints[next(iter(inspect.signature(method).parameters))]
            methods[name] = (method, request_type)
    return methods


async def serve(
    p2p: P2P, service: object, timeout_s: float = 30.0, errors: Counter[str] | None = None, who: str = ""
) -> list[str]:
    """Register every `rpc_*` method of `service` as a libp2p stream handler `shoal.<method>`.

    Failed requests are counted by kind in `errors` (rpc_refused, rpc_stream_failed, rpc_internal);
    `who` (the node's short peer id) prefixes their log lines."""
    names = []
    errors = Counter() if errors is None else errors
    for name, (method, request_type) in rpc_methods(service).items():
        handler_name = HANDLER_PREFIX + name
        handler = _dispatcher(name, method, request_type, timeout_s, errors, who)
        await p2p.add_binary_stream_handler(handler_name, handler)
        names.append(handler_name)
    return names


async def unserve(p2p: P2P, names: list[str]) -> None:
    for name in names:
        try:
            await p2p.remove_binary_stream_handler(name)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove handler %s: %s", name, e)


def _dispatcher(name: str, method: Handler, request_type: type, timeout_s: float, errors: Counter[str], who: str):
    keep_alive = name in KEEP_ALIVE_RPCS

    async def serve_one(stream: FramedStream, peer: PeerID, wait_s: float | None) -> bool:
        """Answer one request; True when the stream is clean for another (an accepted reply)."""
        try:
            request = await stream.read_message(request_type, wait_s)
            reply = await method(request, stream, peer)
            if reply is not None:
                await stream.write_message(reply)
            if keep_alive and getattr(reply, "accepted", False) is True:
                return True
            await _discard_unread(stream)
        except EndOfStream:
            pass
        except ProtocolError as e:
            errors["rpc_refused"] += 1
            logger.warning("[%s] %s from %s refused: %s", who, name, peer, e)
            await _try_reply(stream, ErrorReply.from_error(e))
            await _discard_unread(stream)
        except (TimeoutError, ConnectionError) as e:
            errors["rpc_stream_failed"] += 1
            logger.info("[%s] %s from %s: stream failed (%s)", who, name, peer, type(e).__name__)
        except Exception as e:
            errors["rpc_internal"] += 1
            logger.exception("[%s] %s from %s failed", who, name, peer)
            await _try_reply(stream, ErrorReply(code="internal", message=f"{type(e).__name__}"[:200]))
        return False

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FramedStream(reader, writer, timeout_s)
        stream.remote_addr = str(stream_info.addr) if getattr(stream_info, "addr", None) else None
        stream.peer = str(stream_info.peer_id)
        try:
            wait_s = None  # the first request is due at once; later ones on a kept stream may wait
            while await serve_one(stream, stream_info.peer_id, wait_s):
                wait_s = SERVE_IDLE_S
        finally:
            stream.close()

    return handle


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


async def open_call(p2p: P2P, peer: PeerID | str, rpc_name: str, timeout_s: float) -> FramedStream:
    peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(peer)
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(peer_id, HANDLER_PREFIX + rpc_name), timeout_s
    )
    stream = FramedStream(reader, writer, timeout_s)
    stream.peer = peer_id.to_base58()
    return stream


class StreamPool:
    """A caller's idle kept streams (`KEEP_ALIVE_RPCS`), per (peer, rpc), for the next call to reuse.

    `take` hands out an idle stream if one is fit (most recently used first) or opens a new one; after
    an accepted exchange the caller `give_back`s it, after anything else it closes it. A kept stream
    can still turn out dead on use (the peer restarted, or closed it while idle): the caller retries
    once on a fresh stream, which receivers already take as a repeat of a request they may have run.
    """

    def __init__(self, p2p: P2P, per_key: int = POOL_PER_KEY, idle_s: float = POOL_IDLE_S):
        self.p2p, self.per_key, self.idle_s = p2p, per_key, idle_s
        self._idle: dict[tuple[str, str], list[tuple[float, FramedStream]]] = {}
        self.opened = 0
        self.opened_by_rpc: Counter[str] = Counter()
        self.reused = 0
        self.found_dead = 0  # kept streams that failed on use (the caller replaced them with a fresh one)

    async def take(self, peer: str, rpc: str, timeout_s: float, fresh: bool = False) -> tuple[FramedStream, bool]:
        """(a stream to `peer`'s `rpc`, whether it was kept from an earlier call)."""
        idle = self._idle.get((peer, rpc), [])
        now = asyncio.get_running_loop().time()
        while idle and not fresh:
            since, stream = idle.pop()
            if now - since <= self.idle_s and stream.reusable:
                stream.timeout_s = timeout_s
                self.reused += 1
                return stream, True
            stream.close()
        stream = await open_call(self.p2p, peer, rpc, timeout_s)
        self.opened += 1
        self.opened_by_rpc[rpc] += 1
        return stream, False

    def give_back(self, peer: str, rpc: str, stream: FramedStream) -> None:
        idle = self._idle.setdefault((peer, rpc), [])
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


async def read_reply(stream: FramedStream, expected: type | tuple[type, ...]) -> Any:
    """The peer's reply (of `expected`, one type or several), or `RemoteError` if it answered with an
    ErrorReply."""
    choices = expected if isinstance(expected, tuple) else (expected,)
    reply = await stream.read_message((*choices, ErrorReply))
    if isinstance(reply, ErrorReply):
        raise RemoteError(reply.code, reply.message)
    return reply


async def call(
    p2p: P2P, peer: PeerID | str, rpc_name: str, request: object, expected: type, timeout_s: float = 10.0
) -> Any:
    """A unary call: one request message, one reply message."""
    stream = await open_call(p2p, peer, rpc_name, timeout_s)
    try:
        await stream.write_message(request)
        return await read_reply(stream, expected)
    finally:
        stream.close()


async def pooled_call(
    pool: StreamPool, peer: str, rpc_name: str, request: object, expected: type, timeout_s: float
) -> Any:
    """A unary call on a kept stream (`rpc_name` in `KEEP_ALIVE_RPCS`): one request, one reply.

    A kept stream found dead (it ended or broke) is replaced by a fresh one at once, so the peer may
    get the request twice: such an rpc must take a repeat as already done. A reply that does not come
    in time is not retried: the peer has the request and is still at it. An accepted reply leaves
    the stream for the next call; any other ends it."""
    for fresh in (False, True):
        stream, kept = await pool.take(peer, rpc_name, timeout_s, fresh=fresh)
        try:
            await stream.write_message(request)
            reply = await read_reply(stream, expected)
        except (RemoteError, TimeoutError):  # an answer, or none in time: a live stream, nothing to retry
            stream.close()
            raise
        except Exception:
            stream.close()
            if kept:
                pool.found_dead += 1
                continue
            raise
        if getattr(reply, "accepted", False) is True:
            pool.give_back(peer, rpc_name, stream)
        else:
            stream.close()
        return reply
    raise AssertionError("unreachable: the fresh stream's outcome is returned or raised")
