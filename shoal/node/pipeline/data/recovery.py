"""Microbatches that lost a peer on their route: reap them at each fresh view of the swarm, then resume
a forward pass from the nearest hop that keeps its output, have a lost backward hop recovered by the
hop after it, or redo the last hop from the gradient this node holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from shoal.node.context import NodeContext
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine, push_forward
from shoal.node.pipeline.data.attempts import Attempts, Ending, InFlight, Outcome
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.node.pipeline.hops import HopFailed, lost_kind
from shoal.protocol.pipeline import ForwardRequest, Hop, RecoverRequest, ResumeForward

logger = logging.getLogger(__name__)


class Recovery:
    """`hops`: the engine's hop layer (base.py); `banned`: peers a replacement hop avoids (those that
    just failed us, and those excluded for good)."""

    def __init__(
        self,
        ctx: NodeContext,
        hops: PipelineEngine,
        attempts: Attempts,
        ledger: MicrobatchLedger,
        banned: Callable[[], set[str]],
    ):
        self.ctx, self.hops, self.attempts, self.ledger, self.banned = ctx, hops, attempts, ledger, banned

    def reap_lost(self, live_peers: set[str]) -> int:
        """Act on in-flight microbatches routed through a peer that left the swarm (its record expired
        or says `leaving`): before coming home, resume the forward pass from the nearest hop upstream
        of the lost one that keeps its output, or send it again; in backward, have the hop after the
        lost one pass its kept gradient to another replica of the lost stage."""
        count = 0
        for wire_id, entry in list(self.attempts.in_flight.items()):
            lost = [p for p in entry.route_peers if p not in live_peers]
            if not lost:
                continue
            count += 1
            if not entry.home:
                if not set(lost) <= entry.recovered:
                    entry.recovered.update(lost)
                    self.hops.spawn(self._resume_forward(wire_id, entry, set(lost), live_peers), f"resume {wire_id}")
                continue
            for peer in lost:
                if peer not in entry.recovered:
                    entry.recovered.add(peer)
                    self.hops.spawn(self._recover(wire_id, entry, peer), f"recover {wire_id}")
        return count

    async def _resume_forward(self, wire_id: str, entry: InFlight, lost: set[str], live: set[str]) -> None:
        """GWTF's recovery in forward: the lost hops get replicas of their stages, and the nearest hop
        upstream of the first lost one that keeps its output passes it on along the new route (the data
        node's own embedding when the first hop was lost). Only if no hop can, the forward pass is
        sent again from the start (a new attempt)."""
        why = f"peer {next(iter(lost))[-8:]} left the swarm"
        first = min(i for i, p in enumerate(entry.route_peers) if p in lost)
        route = list(zip(entry.route_stages, entry.route_peers, strict=True))
        avoid = lost | self.banned()
        for pos in range(first, len(route)):
            stage, peer = route[pos]
            if peer in lost:
                prev = route[pos - 1][1] if pos else self.ctx.peer_id
                nxt = route[pos + 1][1] if pos + 1 < len(route) else self.ctx.peer_id
                replica = self.ctx.router.replace(stage, prev, nxt, avoid) if entry.train else None
                if replica is None:
                    self.attempts.end(wire_id, Ending(Outcome.RESEND, AbandonReason.FORWARD, why))
                    return
                route[pos] = (stage, replica)
        hops = tuple(Hop(stage=s, peer_id=p) for s, p in route)
        resumed = False
        for upstream in range(first - 1, -1, -1):
            if route[upstream][1] not in live:
                continue
            request = ResumeForward(microbatch_id=wire_id, hop=upstream, route=hops)
            try:
                ack = await self.ctx.rpc.resume_forward(route[upstream][1], request, timeout_s=5.0)
            except Exception as e:
                logger.info("[%s] resume %s at hop %d: %s", self.ctx.short_id, wire_id, upstream, e)
                continue
            if ack.accepted:
                resumed = True
                break
        if not resumed and first == 0 and entry.train:
            request = ForwardRequest(microbatch_id=wire_id, origin=self.ctx.peer_id, step=entry.step, hop=0, route=hops,
                                     tokens=entry.packed_tokens)  # fmt: skip
            try:
                await push_forward(self.hops, request, entry.embedded.detach())
                resumed = True
            except HopFailed as e:
                logger.info("[%s] resume %s from its embedding: %s", self.ctx.short_id, wire_id, e)
        if entry.done.done():
            return
        if not resumed:
            self.attempts.end(wire_id, Ending(Outcome.RESEND, AbandonReason.FORWARD, why))
            return
        entry.route_peers = tuple(p for _, p in route)
        self.ledger.resumed += 1
        logger.info("[%s] %s resumed after %s", self.ctx.short_id, wire_id, why)

    async def _recover(self, wire_id: str, entry: InFlight, lost_peer: str) -> None:
        assert entry.backward is not None
        route = entry.backward.route
        where = [i for i, hop in enumerate(route) if hop.peer_id == lost_peer]
        if not where:
            return
        if where[-1] == len(route) - 1:
            await self.redo_hop(wire_id, entry, lost_peer, "it left the swarm")
            return
        downstream = route[where[-1] + 1].peer_id
        notice = RecoverRequest(microbatch_id=wire_id, lost_peer=lost_peer)
        try:
            ack = await self.ctx.rpc.recover(downstream, notice, timeout_s=5.0)
            if ack.accepted:  # the hop after the lost one has it redone: wait for that, within bounds
                self.ledger.recoveries += 1
                entry.recovering += 1
                grace = self.ctx.config.limits.stage_wait_s + self.ctx.config.limits.microbatch_timeout_s
                asyncio.get_running_loop().call_later(grace, self._recovered, entry)
        except Exception as e:
            logger.info("[%s] recover %s via %s: %s", self.ctx.short_id, wire_id, downstream[-8:], e)

    @staticmethod
    def _recovered(entry: InFlight) -> None:
        entry.recovering -= 1

    async def redo_hop(self, wire_id: str, entry: InFlight, lost_peer: str, why: str) -> None:
        """The last hop is gone with its graph: another replica of its stage redoes it. The stand-in
        takes the lost hop's place on the route we keep, so that if it dies too before the gradient
        comes home, the next look at the swarm has the hop redone again."""
        assert entry.backward is not None and entry.grad is not None
        entry.recovering += 1
        try:
            route = await self.hops.delegate_recompute(
                entry.backward, entry.backward.hop, entry.grad, lost_peer, why, entry.packed_tokens
            )
            entry.backward = dataclasses.replace(entry.backward, route=route)
            entry.route_peers = tuple(hop.peer_id for hop in route)
            entry.redone.add(entry.backward.hop)
            self.ledger.recoveries += 1
        except HopFailed as e:
            where = f"backward into stage {entry.backward.route[-1].stage}: {e}"
            self.attempts.end(wire_id, Ending(Outcome.ABANDONED, lost_kind(e, AbandonReason.BACKWARD), where))
        finally:
            entry.recovering -= 1
