"""The health RPC every daemon serves: a ping that says who we are and what we hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hivemind.p2p import PeerID

from shoal.node.net.transport import FramedStream
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from shoal.node.daemon import Node


class HealthService:
    def __init__(self, node: Node):
        self.node = node

    async def rpc_ping(self, request: Ping, stream: FramedStream, peer: PeerID) -> Pong:
        return Pong(
            sent_at=request.sent_at,
            nonce=request.nonce,
            peer_state=self.node.state,
            stage=self.node.stage if self.node.stage is not None else -1,
            protocol_version=PROTOCOL_VERSION,
        )
