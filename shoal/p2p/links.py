"""What this node measured of its links: round trips by ping, bandwidth from the tensors it sent.

Routing weighs what a node observed, never self-reports alone (DESIGN §4.6). Each node pings the
peers it may route to every heartbeat and times every tensor it sends; it advertises its freshest
estimates in its record (`links`), so a data node planning a route also knows the links between
the workers it chains together.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from shoal.p2p.services import NodeRpcs
from shoal.p2p.transport import Transport
from shoal.protocol.messages import Ping

EWMA = 0.3  # weight of a new sample
PING_TIMEOUT_S = 2.0
MAX_PINGED = 16  # peers pinged per heartbeat (the ones we route to first, then a random few)
MAX_ADVERTISED = 16  # links in the node record
MIN_SEND_BYTES = 64 * 1024  # smaller sends say more about latency than bandwidth


@dataclass
class LinkEstimate:
    rtt_s: float | None = None
    bandwidth_Bps: float | None = None
    updated: float = 0.0


class LinkMonitor:
    def __init__(self, transport: Transport | None, my_peer_id: str):
        self.rpcs = None if transport is None else NodeRpcs(transport)
        self.me = my_peer_id
        self.estimates: dict[str, LinkEstimate] = {}
        self.pings_sent = 0
        self.pings_failed = 0

    def _estimate(self, peer: str) -> LinkEstimate:
        return self.estimates.setdefault(peer, LinkEstimate())

    @staticmethod
    def _blend(old: float | None, new: float) -> float:
        return new if old is None else (1 - EWMA) * old + EWMA * new

    async def ping(self, peer: str) -> float | None:
        """One round trip to `peer` in seconds, or None if it did not answer."""
        if self.rpcs is None:
            raise RuntimeError("a link monitor without a transport pings nobody")
        self.pings_sent += 1
        started = time.perf_counter()
        try:
            await self.rpcs.ping(
                peer, Ping(sent_at=time.time(), nonce=random.getrandbits(31)), timeout_s=PING_TIMEOUT_S
            )
        except Exception:
            self.pings_failed += 1
            return None
        rtt = time.perf_counter() - started
        estimate = self._estimate(peer)
        estimate.rtt_s = self._blend(estimate.rtt_s, rtt)
        estimate.updated = time.monotonic()
        return rtt

    async def ping_round(self, peers: list[str], preferred: set[str]) -> list[str]:
        """Ping the peers we route to, then random others, up to MAX_PINGED, all at once; returns the
        peers that did not answer."""
        first = [p for p in peers if p in preferred and p != self.me]
        rest = [p for p in peers if p not in preferred and p != self.me]
        random.shuffle(rest)
        chosen = (first + rest)[:MAX_PINGED]
        answers = await asyncio.gather(*(self.ping(p) for p in chosen))
        return [p for p, rtt in zip(chosen, answers, strict=True) if rtt is None]

    def observe_send(self, peer: str, nbytes: int, seconds: float) -> None:
        """A tensor of `nbytes` reached `peer` (acknowledged) after `seconds`."""
        if nbytes < MIN_SEND_BYTES or seconds <= 0:
            return
        estimate = self._estimate(peer)
        transfer_s = max(seconds - (estimate.rtt_s or 0.0), seconds * 0.1)
        estimate.bandwidth_Bps = self._blend(estimate.bandwidth_Bps, nbytes / transfer_s)
        estimate.updated = time.monotonic()

    def forget(self, live_peers: set[str]) -> None:
        for peer in [p for p in self.estimates if p not in live_peers]:
            del self.estimates[peer]

    def measured(self) -> dict[tuple[str, str], tuple[float, float | None]]:
        """(me, peer) -> (one-way latency s, bandwidth B/s or None) for every peer with a round trip."""
        return {(self.me, p): (e.rtt_s / 2.0, e.bandwidth_Bps) for p, e in self.estimates.items() if e.rtt_s}

    def advertised(self) -> list[dict]:
        """The freshest estimates, for this node's record."""
        fresh = sorted(
            ((p, e) for p, e in self.estimates.items() if e.rtt_s is not None), key=lambda pe: -pe[1].updated
        )[:MAX_ADVERTISED]
        return [
            {"peer_id": p, "latency_s": float(e.rtt_s / 2.0), "bandwidth_Bps": float(e.bandwidth_Bps or 0.0)}
            for p, e in fresh
        ]
