"""The typed RPC layer (shoal/p2p/rpc.py) over the in-memory transport (shoal/p2p/memory.py): the same
frames and decoders as over libp2p, in one event loop, in milliseconds."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from shoal.node.rpcs import EngineRpcs
from shoal.p2p.memory import MemoryNetwork, PeerUnreachable
from shoal.p2p.rpc import Rpc, Service, StreamPool, serve
from shoal.p2p.services import NodeRpcs
from shoal.p2p.streams import FramedStream, RemoteError, read_reply
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.pipeline import Ack, ForwardRequest, Hop, StepClose
from shoal.protocol.tensors import TensorSpec

A, B = "QmMemoryPeerA", "QmMemoryPeerB"
SPEC = TensorSpec("float32", (None, None, 4))


def pong(request: Ping) -> Pong:
    return Pong(sent_at=request.sent_at, nonce=request.nonce, peer_state="active", stage=1, protocol_version=1)


def test_every_rpc_has_one_name_its_declaration_gives_it() -> None:
    for service in (NodeRpcs, EngineRpcs):
        rpcs = service.rpcs()
        assert all(rpc.name == name and rpc.protocol == f"shoal.rpc_{name}" for name, rpc in rpcs.items())
    names = [*NodeRpcs.rpcs(), *EngineRpcs.rpcs()]
    assert len(names) == len(set(names))
    assert isinstance(EngineRpcs.forward, Rpc) and EngineRpcs.forward.keep_alive


def test_a_unary_call_through_a_stub_reaches_the_declared_handler_and_a_missing_one_is_refused() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        server, client = network.transport(A), network.transport(B)
        seen: list[str] = []

        async def ping(request: Ping, sender: str) -> Pong:
            seen.append(sender)
            return pong(request)

        await serve(server, NodeRpcs, {NodeRpcs.ping: ping})
        answer = await NodeRpcs(client).ping(A, Ping(sent_at=1.5, nonce=7), timeout_s=1.0)
        assert (answer.nonce, seen) == (7, [B])
        with pytest.raises(PeerUnreachable):  # a mapping serves only what it handles
            await NodeRpcs(client).reach(A, None, timeout_s=1.0)  # type: ignore[arg-type]

        engine: dict = {}  # a node between engines: every engine RPC answered with its refusal
        await serve(server, EngineRpcs, lambda: engine, refuse=lambda rpc: Ack(accepted=False, reason=rpc.refusal))
        notice = await EngineRpcs(client).step_close(A, StepClose(step=0, completed=1, abandoned=0), timeout_s=1.0)
        assert (notice.accepted, notice.reason) == (False, EngineRpcs.step_close.refusal)

    asyncio.run(main())


def test_a_handler_that_raises_answers_an_error_and_a_malformed_request_is_refused_and_counted() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        server, client = network.transport(A), network.transport(B)
        errors: Counter[str] = Counter()

        async def broken(request: Ping, sender: str) -> Pong:
            raise ValueError("a bug")

        await serve(server, NodeRpcs, {NodeRpcs.ping: broken}, errors=errors)
        with pytest.raises(RemoteError, match="internal"):
            await NodeRpcs(client).ping(A, Ping(sent_at=0.0, nonce=1))
        stream = await NodeRpcs(client).ping.open(A, 1.0)
        await stream.write_frame(b"\x93not a message")
        with pytest.raises(RemoteError, match="malformed"):
            await read_reply(stream, Pong)
        assert (errors["rpc_internal"], errors["rpc_refused"]) == (1, 1)

    asyncio.run(main())


def test_a_kept_stream_serves_many_hops_and_a_killed_peer_breaks_it_and_cannot_be_reached() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        server, client = network.transport(A), network.transport(B)
        received: list[torch.Tensor] = []

        async def forward(request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
            received.append(await stream.read_tensor(SPEC))
            return Ack(accepted=True)

        await serve(server, EngineRpcs, {EngineRpcs.forward: forward})
        pool = StreamPool(client)
        request = ForwardRequest(microbatch_id="mb", origin=B, step=0, hop=0, route=(Hop(stage=1, peer_id=A),))
        for i in range(3):
            stream, kept = await pool.take(A, EngineRpcs.forward, 1.0)
            assert kept == (i > 0)
            await stream.write_tensor(torch.full((1, 2, 4), float(i)), "float32", leading=(request,))
            assert (await read_reply(stream, Ack)).accepted
            pool.give_back(A, EngineRpcs.forward, stream)
        assert [float(x[0, 0, 0]) for x in received] == [0.0, 1.0, 2.0]
        assert (pool.opened, pool.reused) == (1, 2)

        stream, kept = await pool.take(A, EngineRpcs.forward, 1.0)
        network.kill(A)
        with pytest.raises(ConnectionResetError):
            await stream.write_tensor(torch.zeros(1, 2, 4), "float32", leading=(request,))
        with pytest.raises(PeerUnreachable):
            await pool.take(A, EngineRpcs.forward, 1.0, fresh=True)

    asyncio.run(main())


def test_a_service_lists_its_rpcs_through_subclasses() -> None:
    class Base(Service):
        ping = Rpc(Ping, Pong)

    class More(Base):
        close = Rpc(StepClose, Ack, keep_alive=True)

    assert list(More.rpcs()) == ["ping", "close"] and More.close.keep_alive


def test_no_rpc_is_named_by_a_string_outside_its_declaration() -> None:
    """Callers and handlers name an RPC by its declaration (`EngineRpcs.abandon`): a string naming one
    (`"rpc_abandon"`, `"shoal.rpc_abandon"`, `"abandon"` as a handler's key) appears nowhere in shoal."""
    import ast
    from pathlib import Path

    import shoal

    names = {*NodeRpcs.rpcs(), *EngineRpcs.rpcs()}
    spelled = {f"rpc_{n}" for n in names} | {f"shoal.rpc_{n}" for n in names}
    found = []
    for path in Path(shoal.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in spelled:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Dict):  # a handler table keyed by name
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                values = [v for v in node.values if isinstance(v, ast.Attribute) and v.attr.startswith("on_")]
                if keys & names and values:
                    found.append(f"{path.name}:{node.lineno} handlers keyed {sorted(keys & names)}")
    assert found == []
