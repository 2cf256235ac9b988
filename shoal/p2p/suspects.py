"""Peers that just failed us, out of every choice at once.

A killed peer's record lives on in the DHT for up to its TTL, so a view read from it lists the dead
for seconds. A refused dial, a failed stream or an unanswered ping is better evidence than a record:
the node marks the peer suspect at once, and its view (what routing, copying, repairing and
averaging choose from) leaves the suspect out until it answers a ping again or its record goes.

`watch_peers` finds the dead without waiting for work to fail on them: a peer killed on its host
closes its connections with it, so a listed peer that drops off libp2p's connected peers is pinged
at once, and suspected if it does not answer; suspects are pinged again every WATCH_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.p2p.transport import Transport

logger = logging.getLogger(__name__)

MAX_SUSPECTS = 1024  # a bound on what a flood of failures can make us hold
WATCH_S = 0.5  # how often the connected peers are listed and the suspects pinged


@dataclass(frozen=True)
class Suspicion:
    since: float  # time.monotonic() of the first failure since the peer was last fine
    reason: str


class Suspects:
    """`mark` on a failure, `clear` when the peer answers again; `on_change` runs after either changes
    the set, so the node can take the suspects out of its view at once. `own_id`: the node itself,
    which it never suspects (a dial to oneself fails, and a node out of its own view is lost for good)."""

    def __init__(
        self,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        own_id: str | None = None,
    ):
        self._marked: dict[str, Suspicion] = {}
        self.on_change = on_change
        self._clock = clock
        self.own_id = own_id

    def mark(self, peer_id: str, reason: str) -> bool:
        """Suspect `peer_id`; True if it was not suspected already."""
        if peer_id == self.own_id:
            logger.warning("not suspecting this node itself: %s", reason[:120])
            return False
        if peer_id in self._marked:
            return False
        if len(self._marked) >= MAX_SUSPECTS:
            self._marked.pop(next(iter(self._marked)))
        self._marked[peer_id] = Suspicion(self._clock(), reason[:200])
        logger.info("suspect %s: %s", peer_id[-8:], reason[:120])
        self._changed()
        return True

    def clear(self, peer_id: str) -> bool:
        """It answered (or left the view): trust it again; True if it was suspected."""
        if self._marked.pop(peer_id, None) is None:
            return False
        self._changed()
        return True

    def keep_only(self, peer_ids: set[str]) -> None:
        """Forget suspects no longer listed at all: their records expired, nothing to leave out. No
        `on_change`: the caller takes the view this comes from next anyway."""
        for peer in [p for p in self._marked if p not in peer_ids]:
            del self._marked[peer]

    def current(self) -> frozenset[str]:
        return frozenset(self._marked)

    def since(self, peer_id: str) -> float | None:
        marked = self._marked.get(peer_id)
        return marked.since if marked is not None else None

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._marked

    def __len__(self) -> int:
        return len(self._marked)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


async def watch_peers(
    transport: Transport,
    suspects: Suspects,
    listed: Callable[[], set[str]],
    stop: asyncio.Event,
    pings: Callable[[str], Awaitable[bool]],
) -> None:
    """Until `stop`: suspect a listed peer that dropped off our connections and does not answer a
    ping; trust a suspect again once it answers one."""
    connected: set[str] = set()
    while not stop.is_set():
        try:
            now = await transport.connected_peers()
        except Exception as e:  # the daemon is shutting down, or busy: look again next time
            logger.debug("could not list connected peers: %r", e)
            now = connected
        dropped = (connected - now) & listed()
        to_ping = sorted(dropped | suspects.current())
        answers = await asyncio.gather(*(pings(peer) for peer in to_ping), return_exceptions=True)
        for peer, answer in zip(to_ping, answers, strict=True):
            if answer is True:
                suspects.clear(peer)
            else:
                suspects.mark(peer, "disconnected and no answer to a ping" if peer in dropped else "no answer")
        connected = now
        try:
            await asyncio.wait_for(stop.wait(), WATCH_S)
        except TimeoutError:
            pass
