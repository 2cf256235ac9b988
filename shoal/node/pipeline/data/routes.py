"""Where a data node sends its next microbatch: a full route from the node's routing policy, or a
SkipPipe partial path (with the step's shared timetable, its release time), and CheckFree+'s swapped
variants of a route."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from shoal.node.context import NodeContext
from shoal.node.pipeline.base import STAGE_POLL_S
from shoal.planning.peer_router import Routed
from shoal.planning.skippipe import SkipPipeOptions
from shoal.planning.swarm import Swarm
from shoal.planning.swarm_view import SwarmView
from shoal.planning.timetable import PlannedPath, full_pass_step, plan_step, reads_swarm, shared_swarm
from shoal.train.repair import swap_variant, swapped_order

logger = logging.getLogger(__name__)


class DataRoutes:
    """`banned()`: peers to avoid if any route avoids them (those that just failed us, and those
    excluded); `excluded()`: peers never to route through, whatever else is left."""

    def __init__(self, ctx: NodeContext, banned: Callable[[], set[str]], excluded: Callable[[], set[str]]):
        self.ctx = ctx
        self.run = ctx.run
        self.banned = banned
        self.excluded = excluded
        self.planned: dict[int, PlannedPath] = {}  # SkipPipe: this step's paths by microbatch index
        self.step_started = time.monotonic()
        self.step_wall = time.time()  # the same moment on the wall clock, which planned hop starts use
        self.full_pass = False  # SkipPipe: this step runs every stage (the periodic full pass)
        self.plan_digest: str | None = None  # the shared timetable's digest (data nodes compare it)
        self.shared: tuple[Swarm, dict[str, int]] | None = None  # SkipPipe: the swarm read, peer -> node id
        self.swarm_changed = False  # this step read a swarm other than the one before (the driver reports it)
        self.swapped = 0  # CheckFree+: microbatches sent with swapped partner stages

    @property
    def skippipe(self) -> bool:
        return self.ctx.config.placement.paths == "skippipe"

    def _options(self, microbatches: int) -> SkipPipeOptions:
        placement, skippipe = self.ctx.config.placement, self.run.skippipe
        return SkipPipeOptions(  # a few perturbed re-plans per step: it plans every step
            skip=placement.skip,
            max_swaps=placement.max_swaps,
            max_jump=skippipe.max_jump or None,
            search_budget=4 * microbatches,
        )

    async def begin_step(self, step: int) -> None:
        """SkipPipe: plan step `step`'s paths now, its start being the time releases count from: the
        shared timetable, the node's own paths (`[skippipe] timetable = false`), or, every
        `full_pass_every`th step, none (full routes). The shared swarm is read afresh from the DHT at
        the first step and after each full pass (`reads_swarm`), and kept in between: every data node
        then plans from the same reading, where views refreshed by each node's own heartbeat lag each
        other by seconds (seen: 7 steps). A peer that fails us in between is routed around per microbatch."""
        self.step_started, self.step_wall, self.planned, self.plan_digest = time.monotonic(), time.time(), {}, None
        every = self.run.skippipe.full_pass_every
        self.full_pass = self.skippipe and full_pass_step(step, every)
        if not self.skippipe or self.full_pass:
            return
        self.swarm_changed = False
        if self.shared is None or reads_swarm(step, every):
            view = await self.ctx.refresh_view()
            shared = shared_swarm(view, self.ctx.router.cost)
            self.swarm_changed = self.shared is None or shared[0] != self.shared[0]
            self.shared = shared
        n = self.run.microbatches_per_step
        if self.run.skippipe.timetable:
            swarm, ids = self.shared
            timetable = plan_step(swarm, ids, self.ctx.router.cost, self.run.run_id, step, n, self._options(n))
            if timetable is None:
                logger.info("[%s] step %d: no timetable (a stage has nobody); full routes", self.ctx.short_id, step)
                return
            self.plan_digest = timetable.digest
            self.planned = dict(enumerate(timetable.paths_of(self.ctx.peer_id)))
        else:
            routed = self.ctx.router.plan_paths(self.ctx.peer_id, n, self._options(n)) or []
            self.planned = {i: PlannedPath(r.hops, 0.0) for i, r in enumerate(routed)}

    @property
    def planned_over(self) -> Swarm | None:
        """The shared swarm of the latest reading (the simulator can replay it: benchmarks)."""
        return None if self.shared is None else self.shared[0]

    def on_the_clock(self, relative: tuple[float, ...]) -> tuple[float, ...]:
        """Planned times in seconds after the step's start, as wall-clock times for the hops."""
        return tuple(self.step_wall + t for t in relative)

    async def released(self, index: int) -> None:
        """Wait for microbatch `index`'s planned release (at once without a timetable)."""
        path = self.planned.get(index)
        if path is not None:
            await asyncio.sleep(max(0.0, self.step_started + path.release_s - time.monotonic()))

    async def next(self, train: bool = True, index: int | None = None) -> Routed | None:
        """A route for the next microbatch: through one live replica of every block stage from the
        node's routing policy, or (`--paths skippipe`, training only: evaluation always runs the whole
        model) microbatch `index`'s planned partial path, a peer that just failed us replaced by
        another replica of its stage (the path then no longer keeps its planned times). While some
        stage has none, wait for one (bounded by the node's stage wait); None if it never came."""
        router = self.ctx.router
        path = self.planned.get(index) if train and index is not None else None

        def route_now(view: SwarmView) -> Routed | None:
            banned = self.banned()
            hops = self._avoiding(path.hops, banned) if path is not None else None
            if hops is not None:
                timed = hops == path.hops  # a replaced hop voids the planned times
                origin = router.ids.get(self.ctx.peer_id, -1)
                return Routed(hops, origin, (), *((path.forward_s, path.backward_s) if timed else ((), ())))
            route = router.route(self.ctx.peer_id, exclude=banned)
            if route is None:  # a ban is a preference, not a verdict
                route = router.route(self.ctx.peer_id, exclude=self.excluded())  # never those
            return route

        return await self.ctx.wait_for(route_now, self.ctx.config.limits.stage_wait_s, poll_s=STAGE_POLL_S)

    def _avoiding(self, hops: tuple[tuple[int, str], ...], banned: set[str]) -> tuple[tuple[int, str], ...] | None:
        """`hops` with each banned peer replaced by a replica of its stage; None if a stage has none."""
        out = list(hops)
        for i, (stage, peer) in enumerate(out):
            if peer in banned:
                prev = out[i - 1][1] if i else self.ctx.peer_id
                nxt = out[i + 1][1] if i + 1 < len(out) else self.ctx.peer_id
                replica = self.ctx.router.replace(stage, prev, nxt, banned)
                if replica is None:
                    return None
                out[i] = (stage, replica)
        return tuple(out)

    def swapped_for(self, routed: Routed, step: int, microbatch: int) -> Routed:
        """CheckFree+: a share of the microbatches run with the edge block stages swapped with their
        partners, so that each learns to stand in for the other and a lost edge stage can be rebuilt by
        copying its partner (`swap_variant`: by the microbatch's place in the run, as the benchmarks)."""
        variant = swap_variant(step, microbatch, self.run.microbatches_per_step, self.run.repair.swaps)
        if variant is None:
            return routed
        peers = dict(routed.hops)
        order = swapped_order([s for s, _ in routed.hops], self.run.pipeline.stages, variant)
        self.swapped += 1  # a swapped path is not the one planned: its hops have no planned starts
        return replace(routed, hops=tuple((s, peers[s]) for s in order), forward_s=(), backward_s=())
