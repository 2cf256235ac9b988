"""The pipeline RPCs every node serves, handed to whatever this node runs now (worker or data).

An engine answers the requests it has a handler for (`on_<name>`); the rest are refused as "not
served here", so the service never needs to know which kind of engine it talks to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hivemind.p2p import PeerID

from shoal.node.net.transport import FramedStream
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackwardRequest,
    ForwardRequest,
    GossipRequest,
    OutputRequest,
    RecomputeRequest,
    RecoverRequest,
    StageCopyRequest,
    StepClose,
)

if TYPE_CHECKING:
    from shoal.node.daemon import Node


class PipelineService:
    def __init__(self, node: Node):
        self.node = node

    def _handler(self, name: str):
        return getattr(self.node.engine, name, None)

    async def rpc_forward(self, request: ForwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_forward")
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        return await handler(request, stream, peer.to_base58())

    async def rpc_backward(self, request: BackwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_backward")
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        return await handler(request, stream, peer.to_base58())

    async def rpc_recompute(self, request: RecomputeRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_recompute")
        if handler is None:
            return Ack(accepted=False, reason="this node redoes no block stage")
        return await handler(request, stream, peer.to_base58())

    async def rpc_fetch_output(self, request: OutputRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("on_fetch_output")
        if handler is None:
            return Ack(accepted=False, reason="not ready")
        await handler(request, stream, peer.to_base58())
        return None

    async def rpc_abandon(self, notice: AbandonNotice, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_abandon")
        return Ack(accepted=False, reason="not ready") if handler is None else await handler(notice, peer.to_base58())

    async def rpc_recover(self, request: RecoverRequest, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_recover")
        return (
            Ack(accepted=False, reason="not served here")
            if handler is None
            else await handler(request, peer.to_base58())
        )

    async def rpc_step_close(self, close: StepClose, stream: FramedStream, peer: PeerID) -> Ack:
        handler = self._handler("on_step_close")
        return (
            Ack(accepted=False, reason="not served here") if handler is None else await handler(close, peer.to_base58())
        )

    async def rpc_gossip(self, request: GossipRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("on_gossip")
        if handler is None:
            return Ack(accepted=False, reason="this node averages no stage")
        return await handler(request, stream, peer.to_base58())

    async def rpc_copy_stage(self, request: StageCopyRequest, stream: FramedStream, peer: PeerID) -> Ack | None:
        handler = self._handler("on_copy_stage")
        if handler is None:
            return Ack(accepted=False, reason="this node holds no block stage")
        await handler(request, stream, peer.to_base58())
        return None
