"""Who may send a stage worker what. A hop is taken only where its route names this node and its
stage, and only along a route a data node could have sent (route_problem); a forward only from the
hop before ours; a gradient, or a recompute, only from the hop after
ours, and a gradient only for the microbatch as we forwarded it, from the peer that took our output
or a replica of its stage that redid that hop; a step close or a step audit only from a data node of
this run. Every refusal is counted and said in one bounded log line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.worker.kept import KeptState, Saved
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.planning.paths import swap_count
from shoal.planning.swarm_view import ROLE_DATA
from shoal.protocol.pipeline import BackwardRequest, ForwardRequest, Hop, RecomputeRequest, check_hop

logger = logging.getLogger(__name__)


def route_problem(origin: str, route: Sequence[Hop], stages: int) -> str | None:
    """Why no data node of a run of `stages` stages sends a microbatch along `route`, if none does: a
    route names each peer once (its origin included: no hop is the data node, no node two hops, so no
    node is ever asked to pass a hop to itself or to take one from itself), and visits block stages
    1..stages-1, each at most once, ascending up to swaps of neighbours (SkipPipe, CheckFree+)."""
    peers = [origin, *(hop.peer_id for hop in route)]
    if len(set(peers)) < len(peers):
        return "the route names one peer at two places"
    order = [hop.stage for hop in route]
    if any(not 1 <= s < stages for s in order):
        return f"the route names a stage outside 1..{stages - 1}"
    if len(set(order)) < len(order) or swap_count(order) is None:
        return f"the route's stages {tuple(order)[:8]} are out of order"
    return None


class Admission:
    """The checks of a worker of `stage`; `hops` says which peers our view lists."""

    def __init__(self, hops: PipelineEngine, stage: int, kept: KeptState, clock: StepClock) -> None:
        self.hops, self.ctx, self.stage = hops, hops.ctx, stage
        self.kept, self.clock = kept, clock
        self.refused = 0  # requests a peer was not entitled to send

    def refuse(self, sender: str, microbatch_id: str, why: str) -> str:
        """Say (bounded: one line per refusal, peer strings escaped by the log formatter) that a peer
        sent what it may not, and return the reason for its Ack."""
        self.refused += 1
        logger.warning("[%s] refused %s from %s: %s", self.ctx.short_id, microbatch_id[:96], sender[-8:], why)
        return why

    def check_hop(self, request: ForwardRequest | BackwardRequest | RecomputeRequest, sender: str) -> str | None:
        """Why the hop a request names is not ours to take, if it is not."""
        check_hop(request)
        if request.hop < 0 or request.hop >= len(request.route):
            return "this node is not the data node of that microbatch"
        hop = request.route[request.hop]
        if hop.peer_id != self.ctx.peer_id or hop.stage != self.stage:
            return f"this node holds stage {self.stage}, not stage {hop.stage}"
        problem = route_problem(request.origin, request.route, self.ctx.run.pipeline.stages)
        if problem is not None:
            return self.refuse(sender, request.microbatch_id, problem)
        return None

    def check_forward(self, request: ForwardRequest, sender: str) -> str | None:
        refusal = self.check_hop(request, sender)
        previous = request.origin if request.hop == 0 else request.route[request.hop - 1].peer_id
        if refusal is None and sender != previous:
            refusal = self.refuse(sender, request.microbatch_id, "a forward comes only from the hop before ours")
        return refusal

    def check_recompute(self, request: RecomputeRequest, sender: str) -> str | None:
        refusal = self.check_hop(request, sender)
        home = request.hop + 1 == len(request.route)
        if refusal is None and sender != (request.origin if home else request.route[request.hop + 1].peer_id):
            refusal = self.refuse(sender, request.microbatch_id, "a recompute comes only from the hop after")
        return refusal

    async def check_gradient_sender(
        self, request: BackwardRequest | RecomputeRequest, saved: Saved, sender: str
    ) -> str | None:
        """A gradient is taken only for the microbatch as we forwarded it, and only from the peer we
        passed its output to, or from a live replica of that stage that redid the hop (a recompute)."""
        mb = request.microbatch_id
        if (request.origin, request.hop, request.step) != (saved.origin, saved.hop, saved.step):
            return self.refuse(sender, mb, "a gradient names another data node, hop or step than its forward")
        home = request.hop + 1 == len(request.route)
        named = request.origin if home else request.route[request.hop + 1].peer_id
        if sender != named:
            return self.refuse(sender, mb, "a gradient comes only from the hop after ours")
        if sender == saved.next_peer or (home and saved.next_stage is None):
            return None
        if saved.next_stage is not None and await self.hops.listed(sender, (saved.next_stage,)):
            return None  # the hop after ours was redone by another replica of its stage
        return self.refuse(sender, mb, "a gradient from a peer that did not take our output")

    async def is_data_node(self, peer_id: str) -> bool:
        """A peer whose training microbatches we took lately (at the first hop only from the data node
        itself) or whose gradient we hold, or a live data node in our view (every live worker hears each
        step close, served or not). A data node that just joined may be missing from a view a heartbeat
        old: `listed` reads it afresh (rate-limited) for a peer it lacks."""
        if peer_id in self.kept.served or peer_id in self.clock.contributors:
            return True
        if self.kept.holds_from(peer_id):
            return True

        def lists() -> bool:
            view = self.ctx.view
            return view is not None and any(n.peer_id == peer_id and n.role == ROLE_DATA for n in view.live_nodes())

        if lists():
            return True
        await self.hops.listed(peer_id)  # reads the view afresh (at most so often) when it lacks the peer
        return lists()
