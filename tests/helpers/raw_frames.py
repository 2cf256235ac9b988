"""Messages sent by hand to a live peer over a real libp2p stream, as a hostile or careless peer would.

`send_with_tensor` sends a request and its tensor as a hop does, but with nothing checked on our
side: no route, no retry. `send_raw_frame` sends bytes as they are: our own encoder refuses to write
a message that breaks the wire schema (a NaN, a list over its bound, a hostile string), so a test
that checks the receiver's decoder refuses it too builds the document by hand and packs it with
msgpack. `announce_data_node` lists a hand-built client as a data node of a run, as any peer may
list itself: what a worker takes only from a listed data node (a step close) can then be sent by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack
import torch
from hivemind.utils import get_dht_time

from shoal.dht.swarm import SwarmDHT
from shoal.p2p.health import node_handlers
from shoal.p2p.rpc import Rpc, serve
from shoal.p2p.services import NodeRpcs
from shoal.p2p.streams import RemoteError, read_reply
from shoal.p2p.transport import Transport
from shoal.planning.swarm_view import ROLE_DATA, STATE_ACTIVE
from shoal.protocol.codec import encode
from shoal.protocol.pipeline import Ack
from shoal.protocol.registry import tag_of
from shoal.protocol.tensors import TensorMeta, frame_payload
from shoal.protocol.version import PROTOCOL_VERSION

Reply = TypeVar("Reply")


def unchecked_encode(message: object) -> bytes:
    """A message in the wire's envelope with none of the sender's schema checks: what a hostile peer's
    own encoder writes (a negative hop, a string over its bound). The receiver's decoder must refuse it."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": tag_of(type(message)), "b": _plain(message)}, use_bin_type=True)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


async def send_with_tensor(client: SwarmDHT, peer_id: str, rpc: Rpc, request: object, x: torch.Tensor) -> Ack:
    """One request and its float32 tensor on `rpc` of `peer_id`; the peer's Ack (a RemoteError raises)."""
    return await send_tensor_on(client.transport, peer_id, rpc, request, x)


async def send_tensor_on(transport: Transport, peer_id: str, rpc: Rpc, request: object, x: torch.Tensor) -> Ack:
    """`send_with_tensor` over any transport (the in-process tests' memory transport)."""
    stream = await transport.open(peer_id, rpc.protocol, timeout_s=10)
    try:
        await stream.write_message(request)
        await stream.write_tensor(x, "float32")
        return await read_reply(stream, Ack)
    finally:
        stream.close()


async def send_raw_frame(
    transport: Transport, peer: str, rpc: Rpc, frame: bytes, expected: type[Reply], timeout_s: float = 10.0
) -> Reply | RemoteError:
    """Open `rpc` on `peer`, write `frame` unchecked as one request frame, and read the reply.

    Returns the peer's reply of type `expected`, or the `RemoteError` it answered with instead (a
    decoder's refusal has the code `malformed_message`), so the caller asserts on either. Any other
    failure (a stream that cannot open, a reply that never comes) propagates. The stream is always closed.
    """
    stream = await transport.open(peer, rpc.protocol, timeout_s=timeout_s)
    try:
        await stream.write_frame(frame)
        return await read_reply(stream, expected)
    except RemoteError as error:
        return error
    finally:
        stream.close()


def unchecked_frames(t: torch.Tensor, wire_dtype: str) -> list[bytes | memoryview]:
    """A tensor's header and chunk frames as a careless or hostile sender writes them: in `t`'s own
    bytes, labelled `wire_dtype`, with none of the sender's checks (NaN and Inf go out as they are)."""
    x = t.detach().contiguous()
    raw = memoryview(x.reshape(-1).view(torch.uint8).numpy())
    header, chunks = frame_payload(TensorMeta(dtype=wire_dtype, shape=tuple(x.shape)), raw)
    return [encode(header), *chunks]


def data_node_record(run_id: str, peer_id: str, inner_step: int = 0) -> dict[str, Any]:
    """The record of a data node of `run_id` that has stepped `inner_step` times, built by hand."""
    now = get_dht_time()
    return {
        "kind": "node", "run_id": run_id, "peer_id": peer_id, "maddrs": [], "role": ROLE_DATA, "stage": 0,
        "state": STATE_ACTIVE, "block_throughput": 1.0, "max_inflight": 8, "inner_step": inner_step,
        "outer_epoch": 0, "loss": None, "grad_norm": None, "grad_norm_clipped": None, "repair": None,
        "waiting_for": [], "links": [], "replica_distance": None, "averager_maddrs": [], "model_id": None,
        "reachable": None, "relays": [], "relay_service": False, "excluded": [], "placement_note": None,
        "backup": None,
        "protocol_version": PROTOCOL_VERSION,
        "started_at": now, "updated_at": now,
        "device": {"kind": "cpu", "name": "cpu", "total_bytes": 2**33, "free_bytes": 2**32, "planned_bytes": 2**32,
                   "tokens_per_s": 1e4, "compute_dtype": "float32"},
    }  # fmt: skip


async def announce_data_node(client: SwarmDHT, run_id: str, ttl_s: float = 120.0) -> None:
    """List `client` as a live data node of `run_id`: its own signed record, which any peer may publish
    for itself, and answers to pings, so that the peers that watch it keep it in their views."""
    await serve(client.transport, NodeRpcs, node_handlers(lambda: (STATE_ACTIVE, 0)))
    assert await client.publish_node(data_node_record(run_id, client.peer_id), ttl_s), "no peer stored the record"
