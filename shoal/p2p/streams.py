"""Framed messages and tensors on one byte stream: what a call writes and reads, whatever carries it.

A frame is a 4-byte big-endian length and that many bytes. A call sends a request message (and, for
pipeline calls, tensors as a header frame plus raw chunk frames) and reads the reply. Every read has a
deadline and a size bound checked before the payload is read. The stream itself comes from a
`Transport` (transport.py: libp2p, or memory.py in one process); the RPC layer on top is rpc.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import Any

from shoal.protocol.codec import decode, encode
from shoal.protocol.errors import MalformedMessage, MessageTooLarge
from shoal.protocol.limits import CHUNK_BYTES, MAX_MESSAGE_BYTES
from shoal.protocol.messages import ErrorReply
from shoal.protocol.tensors import TensorAssembler, TensorHeader, TensorSpec

from . import shaper
from .wire_codecs import WIRE_CODECS

logger = logging.getLogger(__name__)

FRAME_LENGTH_BYTES = 4
MAX_FRAME_BYTES = max(MAX_MESSAGE_BYTES, CHUNK_BYTES)
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
        """Send a torch tensor by its wire codec (wire_codecs.py) after the `leading` messages, in the same
        write as its first chunk; returns the tensor's bytes. Each further chunk is a write of its own,
        with the stream's deadline for each."""
        return await WIRE_CODECS[wire_dtype].write(self, tensor, leading, kind)

    async def read_tensor(
        self, spec: TensorSpec, compute_dtype: Any = None, max_bytes: int | None = None, device: Any = None
    ) -> Any:
        """Receive one tensor sent by `write_tensor`, checked against `spec`, its declared size and
        finiteness, onto `device` (default: host memory)."""
        return await WIRE_CODECS[spec.dtype].read(self, spec, compute_dtype, max_bytes, device)

    async def write_exact(self, tensor: Any, wire_dtype: str, kind: str = "outer") -> int:
        """Send a tensor in `wire_dtype` as a plain dtype (int8 values included, never the int8-rows
        codec): for pieces a codec has already made (shoal/train/outer_codec.py). Returns its bytes."""
        from shoal.device import to_host

        return await self.write_piece(to_host(tensor), wire_dtype, (), True, kind)

    async def read_exact(self, spec: TensorSpec, max_bytes: int | None = None, device: Any = None) -> Any:
        """Receive one tensor sent by `write_exact`, checked against `spec`, in its wire dtype."""
        return await self.read_piece(spec, None, max_bytes, device)

    async def write_piece(
        self, tensor: Any, wire_dtype: str, leading: Sequence[object], starts_message: bool, kind: str
    ) -> int:
        """One host tensor as a header frame and its chunk frames, in `wire_dtype` as it is."""
        from shoal.protocol.torch_tensors import tensor_to_frames

        header, chunks = tensor_to_frames(tensor, wire_dtype)
        await self.write_frames([*(encode(m) for m in leading), encode(header), *chunks[:1]], starts_message, kind)
        for chunk in chunks[1:]:
            await self.write_frames((chunk,), False, kind)
        return header.nbytes

    async def read_piece(self, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any) -> Any:
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


async def read_reply(stream: FramedStream, expected: type | tuple[type, ...]) -> Any:
    """The peer's reply (of `expected`, one type or several), or `RemoteError` if it answered with an
    ErrorReply."""
    choices = expected if isinstance(expected, tuple) else (expected,)
    reply = await stream.read_message((*choices, ErrorReply))
    if isinstance(reply, ErrorReply):
        raise RemoteError(reply.code, reply.message)
    return reply
