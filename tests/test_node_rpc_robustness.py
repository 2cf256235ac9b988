"""Hostile bytes at a running daemon's RPC handlers: each gets an error or a closed stream, and the
daemon keeps serving."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.p2p.services import NodeRpcs
from shoal.p2p.streams import FramedStream, RemoteError
from shoal.protocol.codec import encode
from shoal.protocol.errors import ProtocolError
from shoal.protocol.messages import ErrorReply, Ping, Pong
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


async def _raw_exchange(client: SwarmDHT, peer_id: str, payload: bytes) -> str | None:
    """Write raw bytes to the ping handler; the error code it answers, or None if it answers nothing
    (it is still waiting for the rest of a frame, or closed the stream)."""
    stream = await client.transport.open(peer_id, NodeRpcs.ping.protocol, 3)
    try:
        stream.writer.write(payload)
        await stream.writer.drain()
        try:
            reply = await stream.read_message(ErrorReply)
        except (TimeoutError, ProtocolError):
            return None
        return reply.code
    finally:
        stream.close()


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def test_garbage_truncated_oversized_and_wrong_version_are_refused(swarm, tmp_path):
    bootstrap = swarm.start_bootstrap("--run-config", str(write_tiny_run(tmp_path)))
    node = swarm.start_node([bootstrap.maddrs[0]])

    async def scenario():
        client = await SwarmDHT.create(load_identity(None), initial_peers=node.maddrs, client_mode=True)
        try:
            ping = encode(Ping(sent_at=1.0, nonce=7))
            wrong_version = msgpack.packb({"v": 99, "t": "ping", "b": {"sent_at": 1.0, "nonce": 7}})
            cases = {
                "garbage": _frame(b"\xc1\xff\x00garbage"),
                "not a frame": b"\x00\x01",
                "truncated": _frame(ping)[:-3],
                "oversized": (10**9).to_bytes(4, "big") + b"x" * 100,
                "wrong version": _frame(wrong_version),
                "wrong type": _frame(encode(Pong(sent_at=1.0, nonce=1, peer_state="x", stage=1, protocol_version=1))),
                "nothing": b"",
            }
            codes = {name: await _raw_exchange(client, node.peer_id, data) for name, data in cases.items()}
            assert codes["garbage"] == "malformed_message"
            assert codes["truncated"] is None  # waits for the rest, then drops the stream at its deadline
            assert codes["oversized"] == "message_too_large"
            assert codes["wrong version"] == "unsupported_version"
            assert codes["wrong type"] == "unexpected_message"
            assert codes["not a frame"] is None and codes["nothing"] is None

            # Still serving, and a well-formed ping still gets its pong.
            pong = await NodeRpcs(client.transport).ping(node.peer_id, Ping(sent_at=2.5, nonce=42))
            assert (pong.nonce, pong.sent_at, pong.stage) == (42, 2.5, node.stage)
            with pytest.raises(RemoteError, match="unexpected_message"):
                await NodeRpcs(client.transport).ping(node.peer_id, ErrorReply(code="x", message="y"))  # type: ignore[arg-type]
        finally:
            await client.shutdown()

    asyncio.run(scenario())
    assert node.process.poll() is None, node.log()[-2000:]
    assert "Traceback" not in node.log()


def test_framed_stream_refuses_an_oversized_frame_before_reading_it():
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data((5_000_000).to_bytes(4, "big"))
        stream = FramedStream(reader, None, timeout_s=1)  # type: ignore[arg-type]
        from shoal.protocol.errors import MessageTooLarge

        with pytest.raises(MessageTooLarge):
            await stream.read_frame(max_bytes=1024)

    asyncio.run(scenario())


def test_a_whole_hop_goes_into_the_socket_at_once_while_the_daemon_has_not_read_yet():
    """Our end of a stream takes a hop's 256 KiB activation (and more) in the one write, even before
    the p2p daemon reads any of it: with the default send buffer (208 KiB) the write stopped short
    and the rest waited for the daemon to read and the event loop to wake again."""
    import socket
    from pathlib import Path

    from shoal.p2p.streams import SEND_BUFFER_BYTES

    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    if wmem_max < 2**20:
        pytest.skip(f"net.core.wmem_max is {wmem_max}: the kernel caps the buffer below a hop")

    async def scenario():
        ours, daemons = socket.socketpair(socket.AF_UNIX)
        _, writer = await asyncio.open_unix_connection(sock=ours)
        stream = FramedStream(None, writer, timeout_s=5)  # type: ignore[arg-type]
        assert ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(SEND_BUFFER_BYTES, wmem_max)
        await stream.write_frames([b"request", bytes(2**20)])  # nobody reads the other end yet
        assert writer.transport.get_write_buffer_size() == 0
        writer.close()
        daemons.close()

    asyncio.run(scenario())


def test_a_message_and_a_tensor_go_in_one_write_per_chunk_and_read_back_whole():
    """A hop writes its request, the tensor's header and its first chunk at once (one system call to
    the p2p daemon, not six); a tensor of several chunks follows one write per chunk. The reader sees
    the same frames as from separate writes, and an idle or closed kept stream ends cleanly."""
    import socket

    import torch

    from shoal.p2p.streams import EndOfStream
    from shoal.protocol.limits import CHUNK_BYTES
    from shoal.protocol.tensors import TensorSpec

    async def scenario():
        left, right = socket.socketpair()
        reader, left_writer = await asyncio.open_connection(sock=left)  # (a writer dropped closes its socket)
        right_reader, writer = await asyncio.open_connection(sock=right)
        writes = []
        writelines = writer.writelines
        writer.writelines = lambda parts: (writes.append(sum(len(p) for p in parts)), writelines(parts))[1]
        sender, receiver = FramedStream(None, writer, timeout_s=5), FramedStream(reader, None, timeout_s=5)  # type: ignore[arg-type]

        tensor = torch.randn(5 * CHUNK_BYTES // 8)  # three chunks: 2 + 2 + 1 MiB
        reading = asyncio.ensure_future(_read_message_and_tensor(receiver))
        sent = await sender.write_tensor(tensor, "float32", leading=(Ping(sent_at=1.5, nonce=7),))
        ping, received = await reading
        assert (ping.nonce, ping.sent_at) == (7, 1.5) and torch.equal(received, tensor) and sent == tensor.nbytes
        assert len(writes) == 3 and writes[0] > CHUNK_BYTES and writes[1] == CHUNK_BYTES + 4

        with pytest.raises(EndOfStream, match="idle"):
            await receiver.read_message(Ping, wait_s=0.05)
        writer.close()
        with pytest.raises(EndOfStream, match="closed"):
            await receiver.read_message(Ping, wait_s=1)
        left_writer.close()

    async def _read_message_and_tensor(stream: FramedStream):
        message = await stream.read_message(Ping)
        return message, await stream.read_tensor(TensorSpec("float32", (None,)), max_bytes=8 * CHUNK_BYTES)

    asyncio.run(scenario())
