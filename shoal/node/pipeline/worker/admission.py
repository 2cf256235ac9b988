"""Who may send a stage worker what. A hop is taken only where its route names this node and its
stage, and only along a route a data node could have sent (route_problem); a forward only from the
hop before ours; a gradient, or a recompute, only from the hop after ours, and a gradient only for
the microbatch as we forwarded it, from the peer that took our output or a replica of its stage that
redid that hop; a step close or a step audit only from a data node our view lists; a step number
only within the window step_window.py allows. Every refusal is counted and said in one bounded log
line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.worker.kept import KeptState, Saved
from shoal.node.pipeline.worker.step_window import StepWindow
from shoal.planning.paths import swap_count
from shoal.planning.swarm_view import ROLE_DATA, NodeInfo
from shoal.protocol.pipeline import (
    BackwardRequest,
    ForwardRequest,
    Hop,
    RecomputeRequest,
    RedoOutputRequest,
    check_hop,
)

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

    def __init__(self, hops: PipelineEngine, stage: int, kept: KeptState, window: StepWindow) -> None:
        self.hops, self.ctx, self.stage = hops, hops.ctx, stage
        self.kept, self.window = kept, window
        self.refused = 0  # requests a peer was not entitled to send

    def refuse(self, sender: str, microbatch_id: str, why: str) -> str:
        """Say (bounded: one line per refusal, peer strings escaped by the log formatter) that a peer
        sent what it may not, and return the reason for its Ack."""
        self.refused += 1
        logger.warning("[%s] refused %s from %s: %s", self.ctx.short_id, microbatch_id[:96], sender[-8:], why)
        return why

    def check_hop(
        self, request: ForwardRequest | BackwardRequest | RecomputeRequest | RedoOutputRequest, sender: str
    ) -> str | None:
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

    async def step_refusal(self, step: int, training: bool = True) -> str | None:
        """Why a peer may not name data-node step `step` (step_window.py), if it may not. Beyond the
        window, the view is read afresh once before saying no: a record a heartbeat old lags its node."""
        refusal = self.window.refusal(step, training)
        if refusal is not None and 0 <= step <= self.window.last_step:
            await self.hops.read_view_after(time.monotonic())
            refusal = self.window.refusal(step, training)
        return refusal

    async def check_step(
        self, request: ForwardRequest | RecomputeRequest | RedoOutputRequest, sender: str
    ) -> str | None:
        """Why the data node's step a training forward or a recompute names is not one we take (an
        evaluation forward's step moves nothing, and is only range-checked)."""
        training = not isinstance(request, ForwardRequest) or request.needs_backward
        refusal = await self.step_refusal(request.step, training)
        return None if refusal is None else self.refuse(sender, request.microbatch_id, refusal)

    def check_forward(self, request: ForwardRequest, sender: str) -> str | None:
        refusal = self.check_hop(request, sender)
        previous = request.origin if request.hop == 0 else request.route[request.hop - 1].peer_id
        if refusal is None and sender != previous:
            refusal = self.refuse(sender, request.microbatch_id, "a forward comes only from the hop before ours")
        return refusal

    def check_recompute(self, request: RecomputeRequest | RedoOutputRequest, sender: str) -> str | None:
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

    def data_node(self, peer_id: str) -> NodeInfo | None:
        """`peer_id`'s record in our view, if the view lists it as a live data node of this run (a
        signed record: nobody can announce one for another peer; the view leaves our suspects out)."""
        view = self.ctx.view
        if view is None:
            return None
        return next((n for n in view.live_nodes() if n.peer_id == peer_id and n.role == ROLE_DATA), None)

    async def listed_data_node(self, peer_id: str) -> NodeInfo | None:
        """`data_node`, where a peer our view lacks is looked for again in a view read from now on: a
        data node that just joined may be missing from a view a heartbeat old, but it publishes its
        record before it sends anything. Having served a peer's microbatches, or holding its gradient,
        makes nobody a data node."""
        found = self.data_node(peer_id)
        if found is None and await self.hops.read_view_after(time.monotonic()):
            found = self.data_node(peer_id)
        return found

    async def unlisted(self, peer_id: str, since: float) -> bool:
        """Whether a view read that began at `since` or later lists `peer_id` as no live data node
        (False where no such read could be made: a peer is not given up on for a failed read)."""
        if self.data_node(peer_id) is not None:
            return False
        return await self.hops.read_view_after(since) and self.data_node(peer_id) is None
