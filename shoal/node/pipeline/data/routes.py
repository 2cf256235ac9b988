"""Where a data node sends its next microbatch: a full route from the node's routing policy, or a
SkipPipe partial path, and CheckFree+'s swapped variants of a route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from shoal.node.context import NodeContext
from shoal.node.pipeline.hops import STAGE_POLL_S
from shoal.planning.peer_router import Routed
from shoal.planning.skippipe import SkipPipeOptions
from shoal.planning.swarm_view import SwarmView
from shoal.train.repair import swap_variant, swapped_order


class DataRoutes:
    """`banned()`: peers to avoid if any route avoids them (those that just failed us, and those
    excluded); `excluded()`: peers never to route through, whatever else is left."""

    def __init__(self, ctx: NodeContext, banned: Callable[[], set[str]], excluded: Callable[[], set[str]]):
        self.ctx = ctx
        self.run = ctx.run
        self.banned = banned
        self.excluded = excluded
        self.planned: list[Routed] = []  # SkipPipe: this step's planned paths not yet used
        self.swapped = 0  # CheckFree+: microbatches sent with swapped partner stages

    def _planned_path(self) -> Routed | None:
        """SkipPipe: the next planned partial path, planning a step's worth when none is left."""
        if not self.planned:
            n = self.run.microbatches_per_step
            placement = self.ctx.config.placement  # a few perturbed re-plans per step: it plans every step
            options = SkipPipeOptions(skip=placement.skip, max_swaps=placement.max_swaps, search_budget=4 * n)
            self.planned = self.ctx.router.plan_paths(self.ctx.peer_id, n, options) or []
        return self.planned.pop(0) if self.planned else None

    async def next(self, train: bool = True) -> Routed | None:
        """A route for the next microbatch: through one live replica of every block stage from the
        node's routing policy, or (`--paths skippipe`, training only: evaluation always runs the whole
        model) a SkipPipe partial path. While some stage has none, wait for one (bounded by the
        node's stage wait); None if it never came."""
        router = self.ctx.router
        skippipe = train and self.ctx.config.placement.paths == "skippipe"

        def route_now(view: SwarmView) -> Routed | None:
            banned = self.banned()
            if skippipe:
                route = self._planned_path()
                if route is not None and not {p for _, p in route.hops} & banned:
                    return route
                self.planned = []  # a path through a peer that just failed: plan again
            route = router.route(self.ctx.peer_id, exclude=banned)
            if route is None:  # a ban is a preference, not a verdict
                route = router.route(self.ctx.peer_id, exclude=self.excluded())  # never those
            return route

        return await self.ctx.wait_for(route_now, self.ctx.config.limits.stage_wait_s, poll_s=STAGE_POLL_S)

    def swapped_for(self, routed: Routed, step: int, microbatch: int) -> Routed:
        """CheckFree+: a share of the microbatches run with the edge block stages swapped with their
        partners, so that each learns to stand in for the other and a lost edge stage can be rebuilt by
        copying its partner (`swap_variant`: by the microbatch's place in the run, as the benchmarks)."""
        variant = swap_variant(step, microbatch, self.run.microbatches_per_step, self.run.repair.swaps)
        if variant is None:
            return routed
        peers = dict(routed.hops)
        order = swapped_order([s for s, _ in routed.hops], self.run.pipeline.stages, variant)
        self.swapped += 1
        return replace(routed, hops=tuple((s, peers[s]) for s in order))
