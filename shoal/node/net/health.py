"""The health RPC every daemon serves: a ping that says who we are and what we hold."""

from __future__ import annotations

from collections.abc import Callable

from hivemind.p2p import PeerID

from shoal.node.net.transport import FramedStream
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.version import PROTOCOL_VERSION


class HealthService:
    def __init__(self, standing: Callable[[], tuple[str, int | None]]):
        self.standing = standing  # the node's state ("joining", "active", "leaving") and stage

    async def rpc_ping(self, request: Ping, stream: FramedStream, peer: PeerID) -> Pong:
        state, stage = self.standing()
        return Pong(
            sent_at=request.sent_at,
            nonce=request.nonce,
            peer_state=state,
            stage=stage if stage is not None else -1,
            protocol_version=PROTOCOL_VERSION,
        )
