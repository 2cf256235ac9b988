"""The part of a node an engine may use (engine.py): who it is, what it trains, how it reaches peers.

An engine gets a `NodeContext` when the node builds it and reads the swarm only through it; it
changes nothing on the node. What the node publishes of the engine it asks for (`Engine.progress`).
Tests build one from real parts (a view, a recording publisher) without starting a node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shoal.config import RunConfig
from shoal.node.config import NodeConfig
from shoal.node.hooks import Hooks
from shoal.node.net.links import LinkMonitor
from shoal.planning.peer_router import PeerRouter
from shoal.planning.swarm_view import SwarmView


@dataclass
class NodeContext:
    peer_id: str
    run: RunConfig
    config: NodeConfig
    p2p: Any  # hivemind.p2p.P2P: the node's libp2p daemon
    router: PeerRouter
    links: LinkMonitor
    started_at: float  # DHT time: seniority among replicas
    max_inflight: int  # microbatches this node holds at once (its advertised in-flight memory)
    current_view: Callable[[], SwarmView | None]
    read_view: Callable[[], Awaitable[SwarmView]]  # a fresh view from the DHT (the node observes it)
    publish: Callable[[], Awaitable[Any]]  # publish the node's record now
    hooks: Hooks

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    @property
    def view(self) -> SwarmView | None:
        """The node's latest view of the swarm (refreshed every heartbeat)."""
        return self.current_view()

    async def refresh_view(self) -> SwarmView:
        return await self.read_view()
