"""The node's view of the swarm, kept current: read from the DHT every heartbeat, and at join without the
peers that do not answer a ping (a killed peer's record lives on until its TTL runs out).

Routing re-plans over the view without the suspects (net/suspects.py), with the links measured so far
and, at a data node, the throughput its microbatches' trips showed (planning/observed.py: claims are
only lowered). The engine hears at once of a peer that failed us, answered again, or came back under
the same peer id having lost what it held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shoal.config import RunConfig
from shoal.dht.swarm import SwarmDHT
from shoal.node.engine import Engine
from shoal.p2p.links import LinkMonitor
from shoal.p2p.restarts import RestartWatch
from shoal.p2p.services import NodeRpcs
from shoal.p2p.suspects import Suspects
from shoal.planning.observed import observed_view
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.swarm_view import SwarmView
from shoal.protocol.messages import Ping

logger = logging.getLogger(__name__)

JOIN_PING_TIMEOUT_S = 3.0


class ViewKeeper:
    def __init__(
        self,
        dht: SwarmDHT,
        run: RunConfig,
        router: PeerRouter,
        links: LinkMonitor,
        engine: Callable[[], Engine | None],
    ) -> None:
        self.dht, self.run, self.router, self.links = dht, run, router, links
        self.engine = engine  # the node's engine now, if it has one
        self.view: SwarmView | None = None  # the last view read, without the suspects
        self.raw_view: SwarmView | None = None  # ... and with them
        self.suspects = Suspects(on_change=self._suspects_changed, own_id=dht.peer_id)
        self.restarts = RestartWatch()

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    async def answering_view(self) -> SwarmView:
        """The swarm view without the peers that do not answer a ping. A killed peer's record lives on
        until its TTL runs out; a joiner that believed it would skip the stage that peer left short."""
        view = await self.dht.read_view(self.run)
        others = [n.peer_id for n in view.nodes if n.peer_id != self.peer_id]
        answers = await asyncio.gather(*(self._answers(peer) for peer in others))
        silent = [peer for peer, ok in zip(others, answers, strict=True) if not ok]
        if silent:
            logger.info(
                "[%s] %d listed peer(s) do not answer: %s", self.short_id, len(silent), [p[-8:] for p in silent]
            )
        for peer in silent:
            self.suspects.mark(peer, "no answer to a ping at join")
        return self.observe(view)

    async def refresh(self) -> SwarmView:
        return self.observe(await self.dht.read_view(self.run))

    def observe(self, view: SwarmView) -> SwarmView:
        """Take a fresh view; returns it without the suspects."""
        self.raw_view = view
        self.suspects.keep_only({n.peer_id for n in view.nodes})
        self._note_restarts(view)
        return self._take(view)

    def listed_peers(self) -> set[str]:
        view = self.raw_view
        return {n.peer_id for n in view.nodes if n.peer_id != self.peer_id} if view is not None else set()

    async def pings(self, peer_id: str) -> bool:
        return await self.links.ping(peer_id) is not None

    def _take(self, raw: SwarmView) -> SwarmView:
        view = raw.without(self.suspects.current()) if len(self.suspects) else raw
        self.view = view
        links = {**view.measured_links(), **self.links.measured()}
        engine = self.engine()
        trips = list(engine.trips()) if engine is not None else []
        routed = observed_view(view, trips, self.router.cost.backward_factor) if trips else view
        self.router.update(Snapshot(routed, self.peer_id, links))
        return view

    def _suspects_changed(self) -> None:
        """A peer failed us or answered again: our choices change now, not at the next heartbeat, and
        the engine acts on what went through a suspect (a data node re-sends or recovers it) now."""
        if self.raw_view is not None:
            view = self._take(self.raw_view)
            engine = self.engine()
            if engine is not None:
                engine.on_view(view)

    def _note_restarts(self, view: SwarmView) -> None:
        """Peers back under the same peer id lost what they held: act on it as if they had left."""
        restarted = self.restarts.restarted(view)
        engine = self.engine()
        if restarted and engine is not None:
            logger.info("[%s] peer(s) restarted: %s", self.short_id, sorted(p[-8:] for p in restarted))
            engine.on_peer_restarted(restarted, {n.peer_id for n in view.live_nodes()})

    async def _answers(self, peer_id: str) -> bool:
        try:
            ping = Ping(sent_at=time.time(), nonce=0)
            await NodeRpcs(self.dht.transport).ping(peer_id, ping, timeout_s=JOIN_PING_TIMEOUT_S)
            return True
        except Exception:
            return False
