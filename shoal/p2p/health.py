"""The health RPC every daemon serves: a ping that says who we are and what we hold."""

from __future__ import annotations

from collections.abc import Callable

from shoal.p2p.reachability import ReachService
from shoal.p2p.rpc import Handlers
from shoal.p2p.services import NodeRpcs
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.version import PROTOCOL_VERSION


class HealthService:
    def __init__(self, standing: Callable[[], tuple[str, int | None]]):
        self.standing = standing  # the node's state ("joining", "active", "leaving") and stage

    async def ping(self, request: Ping, sender: str) -> Pong:
        state, stage = self.standing()
        return Pong(
            sent_at=request.sent_at,
            nonce=request.nonce,
            peer_state=state,
            stage=stage if stage is not None else -1,
            protocol_version=PROTOCOL_VERSION,
        )


def node_handlers(standing: Callable[[], tuple[str, int | None]]) -> Handlers:
    """What a daemon or bootstrap peer answers of `NodeRpcs`: its health, and dial-backs for joiners."""
    return {NodeRpcs.ping: HealthService(standing).ping, NodeRpcs.reach: ReachService().reach}
