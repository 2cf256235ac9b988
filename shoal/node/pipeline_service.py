"""The pipeline RPCs every node serves, handed to whatever this node runs now (worker or data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hivemind.p2p import PeerID

from shoal.node.transport import FramedStream
from shoal.protocol.pipeline import AbandonNotice, Ack, BackwardRequest, ForwardRequest

if TYPE_CHECKING:
    from shoal.node.daemon import Node


class PipelineService:
    def __init__(self, node: Node):
        self.node = node

    async def rpc_forward(self, request: ForwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        engine = self.node.engine
        if engine is None:
            return Ack(accepted=False, reason="not ready")
        return await engine.on_forward(request, stream)

    async def rpc_backward(self, request: BackwardRequest, stream: FramedStream, peer: PeerID) -> Ack:
        engine = self.node.engine
        if engine is None:
            return Ack(accepted=False, reason="not ready")
        return await engine.on_backward(request, stream)

    async def rpc_abandon(self, notice: AbandonNotice, stream: FramedStream, peer: PeerID) -> Ack:
        on_abandon = getattr(self.node.engine, "on_abandon", None)
        if on_abandon is None:
            return Ack(accepted=False, reason="not ready")
        return await on_abandon(notice, peer.to_base58())
