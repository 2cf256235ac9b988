"""The part of a node an engine may use (engine.py): who it is, what it trains, how it reaches peers.

An engine gets a `NodeContext` when the node builds it and reads the swarm only through it; it
changes nothing on the node. What the node publishes of the engine it asks for (`Engine.progress`).
Tests build one from real parts (a view, a recording publisher) without starting a node.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from shoal.config import RunConfig
from shoal.model.checkpoint import Checkpoint
from shoal.node.config import NodeConfig
from shoal.node.hooks import Hooks
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.links import LinkMonitor
from shoal.p2p.suspects import Suspects
from shoal.p2p.transport import Transport
from shoal.planning.peer_router import PeerRouter
from shoal.planning.swarm_view import SwarmView

T = TypeVar("T")
VIEW_POLL_S = 0.2  # how often a wait on the view looks again: the heartbeat refreshes it every ttl/3


@dataclass
class NodeContext:
    peer_id: str
    run: RunConfig
    config: NodeConfig
    transport: Transport  # how it reaches peers: libp2p in a daemon, memory in an in-process test
    router: PeerRouter
    links: LinkMonitor
    started_at: float  # DHT time: seniority among replicas
    max_inflight: int  # microbatches this node holds at once (its advertised in-flight memory)
    current_view: Callable[[], SwarmView | None]
    read_view: Callable[[], Awaitable[SwarmView]]  # a fresh view from the DHT (the node observes it)
    publish: Callable[[], Awaitable[Any]]  # publish the node's record now
    hooks: Hooks
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where it computes (shoal/device.py)
    compute_dtype: torch.dtype | None = None  # autocast's dtype there (None: float32)
    checkpoint: Checkpoint | None = None  # this machine's copy of the checkpoint the run starts from
    suspects: Suspects = field(default_factory=Suspects)  # peers that just failed us (net/suspects.py)
    # the latest view with the suspects still in it: what every listed record announced, dead or not
    # (None: the view itself)
    current_listed_view: Callable[[], SwarmView | None] | None = None

    def __post_init__(self) -> None:
        if self.suspects.own_id is None:  # a node never suspects itself, whoever built its suspects
            self.suspects.own_id = self.peer_id

    @functools.cached_property
    def rpc(self) -> EngineRpcs:
        """The engine RPCs of other nodes, as calls: `await ctx.rpc.abandon(peer, notice)`."""
        return EngineRpcs(self.transport)

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    @property
    def view(self) -> SwarmView | None:
        """The node's latest view of the swarm (refreshed every heartbeat)."""
        return self.current_view()

    @property
    def listed_view(self) -> SwarmView | None:
        """Every record listed now, suspects included: what a node announced still counts after it died
        (a lost stage's backup digests), until its record expires."""
        return self.current_listed_view() if self.current_listed_view is not None else self.view

    async def refresh_view(self) -> SwarmView:
        return await self.read_view()

    async def wait_for(
        self,
        found: Callable[[SwarmView], T | None],
        timeout_s: float | None,
        *,
        poll_s: float = VIEW_POLL_S,
        fresh: bool = False,
        while_waiting: Callable[[SwarmView | None, float], None] | None = None,
    ) -> T | None:
        """Poll the view until `found(view)` is not None and return that, or None once `timeout_s`
        (None: no bound) has passed. `fresh` reads the view from the DHT at every look instead of
        taking the node's latest; `while_waiting(view, waited_s)` runs after each look that found
        nothing (to say what is missing). The one "wait until the swarm shows X" of the node."""
        started = time.monotonic()
        while True:
            view = await self.read_view() if fresh else self.current_view()
            value = found(view) if view is not None else None
            if value is not None:
                return value
            waited = time.monotonic() - started
            if timeout_s is not None and waited >= timeout_s:
                return None
            if while_waiting is not None:
                while_waiting(view, waited)
            await asyncio.sleep(poll_s)
