"""Hostile bytes at a running daemon's RPC handlers: each gets an error or a closed stream, and the
daemon keeps serving."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.transport import FramedStream, RemoteError, call, open_call
from shoal.protocol.codec import encode
from shoal.protocol.errors import ProtocolError
from shoal.protocol.messages import ErrorReply, Ping, Pong
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


async def _raw_exchange(client: SwarmDHT, peer_id: str, payload: bytes) -> str | None:
    """Write raw bytes to the ping handler; the error code it answers, or None if it answers nothing
    (it is still waiting for the rest of a frame, or closed the stream)."""
    stream = await open_call(client.p2p, peer_id, "rpc_ping", timeout_s=3)
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
            pong = await call(client.p2p, node.peer_id, "rpc_ping", Ping(sent_at=2.5, nonce=42), Pong)
            assert (pong.nonce, pong.sent_at, pong.stage) == (42, 2.5, node.stage)
            with pytest.raises(RemoteError, match="unexpected_message"):
                await call(client.p2p, node.peer_id, "rpc_ping", ErrorReply(code="x", message="y"), Pong)
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
