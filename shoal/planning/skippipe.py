"""SkipPipe phase B: partial paths through the block stages, scheduled so microbatches rarely collide.

The authors search with Conflict-Based Search, which did not finish in minutes at 20 nodes on two
cores. We plan one microbatch at a time instead (prioritised planning, a standard cheaper
alternative to CBS): microbatches are taken in the order their data nodes can release them, and
each takes the legal path (see `paths.py`) that finishes its whole forward-loss-backward round
trip earliest given every task already booked. With collision avoidance ("TC2") each task is
booked into its node's timeline, so a microbatch waits for a busy node instead of overlapping,
and a node is never booked beyond its memory. Without it, paths are chosen on network cost alone,
spread only by a per-node share of the stage's visits (the authors' TC1), and timing is left to
the nodes' queues.

A path is grown hop by hop with a small beam; in a large stage only the nodes at the nearest
sites are candidates, so cost grows with microbatches x hops, not with the swarm squared.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from shoal.planning.costs import CostModel
from shoal.planning.group_paths import group_counts, plan_group_paths
from shoal.planning.paths import block_visits, stage_moves, visit_quotas
from shoal.planning.plan import IterationPlan, Route, Timing
from shoal.planning.swarm import NodeId, PlanNode, Swarm
from shoal.planning.timeline import Timeline


class PlanningError(ValueError):
    """The swarm or options admit no plan (an empty stage, a jump cap that cannot reach a stage)."""


@dataclass(frozen=True)
class SkipPipeOptions:
    skip: float = 0.33  # share of block stages a path skips
    max_swaps: int = 0  # adjacent-stage swaps per path (the authors' arXiv code allows 2)
    collision_aware: bool = True  # TC2: book tasks so microbatches wait instead of colliding
    max_jump: int | None = None  # stages a path may jump past its highest visited (authors: 4)
    beam_width: int = 4
    candidate_sites: int = 3  # in a large stage, only nodes at the nearest sites are tried ...
    candidates_per_site: int = 3  # ... this many from each
    small_stage: int = 12  # stages this small have every node tried
    search_budget: int = 600  # microbatch placements across perturbed re-plans (collision-aware only)
    noise: float = 0.1
    # group paths (`group_paths.py`): a few fixed paths per data node, searched in at most
    # min(group_search, 4 x search_budget) timings; only in swarms of at most group_max_nodes nodes
    group_search: int = 2400
    group_restarts: int = 3
    group_max_nodes: int = 64


@dataclass
class _Partial:
    ready_s: float  # when the activation is ready on the last hop
    score: float  # ready_s + the hop home: every path must return to its data node
    hops: tuple[PlanNode, ...]
    forward_starts: tuple[float, ...]
    frontier: int
    pending: int | None
    swaps: int


def plan_skippipe(
    swarm: Swarm,
    cost: CostModel,
    microbatches: int,
    options: SkipPipeOptions,
    rng: random.Random | None = None,
) -> IterationPlan:
    """Routes (and, with collision avoidance, a timetable) for `microbatches` over the data nodes.

    With collision avoidance and an `rng`, the plan is redone while `options.search_budget`
    microbatch placements last (20 plans at the paper's 30 microbatches, one at 600 or more), each
    choice perturbed (paths ranked by finish + U(0, noise) x round trip); the plan with the shortest
    makespan is kept. An anytime search like the authors' CBS, but with a bounded budget. In a small
    swarm a plan with a few fixed paths per data node (the authors' groups; see `group_paths.py`) is
    searched too, and kept when its makespan is shorter.
    """
    best = _Planner(swarm, cost, options, None).plan(microbatches)
    if not options.collision_aware or rng is None:
        return best
    for _ in range(options.search_budget // max(1, microbatches) - 1):
        trial = _Planner(swarm, cost, options, rng).plan(microbatches)
        if trial.predicted_makespan_s < best.predicted_makespan_s - 1e-9:
            best = trial
    evaluations = min(options.group_search, 4 * options.search_budget)
    if evaluations > 0 and len(swarm.nodes) <= options.group_max_nodes:
        visits = block_visits(swarm.stages, options.skip)
        for groups in group_counts(swarm, microbatches, visits)[:1]:
            grouped = plan_group_paths(
                swarm,
                cost,
                microbatches,
                visits,
                groups,
                options.max_swaps,
                options.max_jump,
                evaluations,
                rng,
                options.group_restarts,
            )
            if grouped is not None and grouped.predicted_makespan_s < best.predicted_makespan_s - 1e-9:
                best = grouped
    return best


def microbatches_per_origin(swarm: Swarm, microbatches: int) -> dict[NodeId, int]:
    """Microbatches each data node injects: an equal share, the remainder to the lowest ids."""
    data = swarm.data_nodes
    if not data:
        raise PlanningError("no data node (stage 0) in the swarm")
    base, extra = divmod(microbatches, len(data))
    return {d.node_id: base + (1 if i < extra else 0) for i, d in enumerate(data)}


class _Planner:
    def __init__(self, swarm: Swarm, cost: CostModel, options: SkipPipeOptions, rng: random.Random | None) -> None:
        self.rng = rng
        for s, group in enumerate(swarm.by_stage):
            if not group:
                raise PlanningError(f"stage {s} has no node")
        self.swarm, self.cost, self.opt = swarm, cost, options
        self.visits = block_visits(swarm.stages, options.skip)
        self.timelines = {n.node_id: Timeline() for n in swarm.nodes}
        self.booked_visits = {n.node_id: 0 for n in swarm.nodes}
        self._buckets: dict[tuple[int, int], list[PlanNode]] = {}
        self._cursor: dict[tuple[int, int], int] = {}
        for n in swarm.nodes:
            self._buckets.setdefault((n.stage, n.site), []).append(n)
        for group in self._buckets.values():
            group.sort(key=lambda n: n.node_id)
        self._site_order: dict[tuple[int, int], list[int]] = {}

    # -- the outer loop: one microbatch at a time, in release order --------------------------------

    def plan(self, microbatches: int) -> IterationPlan:
        swarm, opt = self.swarm, self.opt
        left = microbatches_per_origin(swarm, microbatches)
        self.quota = visit_quotas(microbatches, swarm.stages, self.visits)
        self.remaining = microbatches
        self.node_cap = {n.node_id: math.ceil(self.quota[n.stage] / len(swarm.by_stage[n.stage])) for n in swarm.nodes}
        planned = dict.fromkeys(left, 0)
        routes: list[Route] = []
        timings: list[Timing] = []
        # earliest release first; among equals, the data node with the fewest planned so far. A data
        # node's release depends only on its own microbatches (no path visits another's stage 0).
        ready = [(self._release_floor(swarm.node(d), 0.0), 0, d) for d in sorted(left) if left[d] > 0]
        heapq.heapify(ready)
        while ready:
            t0, _, origin_id = heapq.heappop(ready)
            origin = swarm.node(origin_id)
            found = self._best_path(origin, t0)
            if found is None:
                raise PlanningError("no legal path: is max_jump too small to reach every stage?")
            route, timing = found
            self._commit(route, timing)
            routes.append(route)
            if timing is not None:
                timings.append(timing)
            left[origin_id] -= 1
            planned[origin_id] += 1
            if left[origin_id] > 0:
                floor = timing.release_s if timing is not None else 0.0
                heapq.heappush(ready, (self._release_floor(origin, floor), planned[origin_id], origin_id))
        policy = "skippipe" if opt.collision_aware else "skippipe-nocollision"
        return IterationPlan(policy, swarm, tuple(routes), tuple(timings) if opt.collision_aware else None)

    def _release_floor(self, origin: PlanNode, floor: float) -> float:
        if not self.opt.collision_aware:
            return 0.0
        return self.timelines[origin.node_id].free_memory_from(floor, origin.memory)

    def _commit(self, route: Route, timing: Timing | None) -> None:
        for h in route.hops:
            stage = self.swarm.node(h).stage
            self.quota[stage] -= 1
            self.booked_visits[h] += 1
            key = (stage, self.swarm.node(h).site)
            self._cursor[key] = self._cursor.get(key, 0) + 1
        self.remaining -= 1
        if timing is None:
            return
        origin = self.swarm.node(route.origin)
        tl = self.timelines[origin.node_id]
        tl.book(timing.release_s, origin.forward_s)
        tl.book(timing.head_s, self.cost.head_s(origin))
        tl.book(timing.origin_backward_s, self.cost.backward_s(origin))
        self._hold(origin.node_id, timing.end_s)
        for h, f, b in zip(route.hops, timing.forward_s, timing.backward_s, strict=True):
            node = self.swarm.node(h)
            self.timelines[h].book(f, node.forward_s)
            self.timelines[h].book(b, self.cost.backward_s(node))
            self._hold(h, b + self.cost.backward_s(node))

    def _hold(self, node_id: NodeId, end_s: float) -> None:
        self.timelines[node_id].hold(end_s)

    # -- one microbatch: beam search over legal paths ---------------------------------------------

    def _best_path(self, origin: PlanNode, t0: float) -> tuple[Route, Timing | None] | None:
        opt, cost = self.opt, self.cost
        aware = opt.collision_aware
        start = self.timelines[origin.node_id].earliest_slot(t0, origin.forward_s) if aware else t0
        beam = [_Partial(start + origin.forward_s, 0.0, (), (), 0, None, 0)]
        candidates: dict[tuple[int, int], list[PlanNode]] = {}  # (stage, site): fixed while one path grows
        for hop in range(self.visits):
            grown: dict[tuple, _Partial] = {}
            for part in beam:
                here = part.hops[-1] if part.hops else origin
                seen = frozenset(h.stage for h in part.hops)
                moves = stage_moves(
                    part.frontier,
                    part.pending,
                    part.swaps,
                    self.visits - hop,
                    self.quota,
                    self.remaining,
                    opt.max_jump,
                    opt.max_swaps,
                )
                for stage, frontier, pending, swaps in moves:
                    if (stage, here.site) not in candidates:
                        candidates[(stage, here.site)] = self._candidates(stage, here)
                    for node in candidates[(stage, here.site)]:
                        arrive = part.ready_s + cost.transfer_s(self.swarm, here, node)
                        if aware:  # wait for memory, then for a free slot
                            tl = self.timelines[node.node_id]
                            admit = tl.free_memory_from(arrive, node.memory)
                            begin = tl.earliest_slot(admit, node.forward_s)
                        else:
                            if self.booked_visits[node.node_id] >= self.node_cap[node.node_id]:
                                continue
                            begin = arrive
                        key = (node.node_id, seen, pending, swaps)
                        done = begin + node.forward_s
                        old = grown.get(key)
                        if old is None or done < old.ready_s - 1e-12:
                            grown[key] = _Partial(
                                done,
                                done + cost.transfer_s(self.swarm, node, origin),
                                part.hops + (node,),
                                part.forward_starts + (begin,),
                                frontier,
                                pending,
                                swaps,
                            )
            beam = sorted(grown.values(), key=lambda p: (p.score, [h.node_id for h in p.hops]))
            beam = beam[: opt.beam_width]
            if not beam:
                return None
        best = None
        for part in beam:
            timing = self._finish(origin, start, part)
            score = timing.end_s + (self.rng.uniform(0.0, opt.noise) * (timing.end_s - start) if self.rng else 0.0)
            if best is None or score < best[0] - 1e-12:
                best = (score, part, timing)
        assert best is not None
        _, part, timing = best
        route = Route(origin.node_id, tuple(h.node_id for h in part.hops))
        return route, (timing if aware else None)

    def _finish(self, origin: PlanNode, release: float, part: _Partial) -> Timing:
        """Time the rest of the round trip: back to the data node, loss, and backward in reverse."""
        cost, swarm, aware = self.cost, self.swarm, self.opt.collision_aware

        def slot(node: PlanNode, ready: float, duration: float) -> float:
            return self.timelines[node.node_id].earliest_slot(ready, duration) if aware else ready

        last = part.hops[-1]
        head = slot(origin, part.ready_s + cost.transfer_s(swarm, last, origin), cost.head_s(origin))
        t, prev = head + cost.head_s(origin), origin
        backward = [0.0] * len(part.hops)
        for i in reversed(range(len(part.hops))):
            node = part.hops[i]
            backward[i] = slot(node, t + cost.transfer_s(swarm, prev, node), cost.backward_s(node))
            t, prev = backward[i] + cost.backward_s(node), node
        origin_bwd = slot(origin, t + cost.transfer_s(swarm, prev, origin), cost.backward_s(origin))
        end = origin_bwd + cost.backward_s(origin)
        return Timing(release, part.forward_starts, head, tuple(backward), origin_bwd, end)

    # -- which nodes of a stage to try --------------------------------------------------------------

    def _candidates(self, stage: int, here: PlanNode) -> list[PlanNode]:
        group = self.swarm.by_stage[stage]
        if len(group) <= self.opt.small_stage:
            return list(group)
        out: list[PlanNode] = []
        for site in self._nearest_sites(stage, here.site)[: self.opt.candidate_sites]:
            bucket = self._buckets[(stage, site)]
            at = self._cursor.get((stage, site), 0)
            take = min(self.opt.candidates_per_site, len(bucket))
            out.extend(bucket[(at + i) % len(bucket)] for i in range(take))
        return out

    def _nearest_sites(self, stage: int, site: int) -> list[int]:
        key = (stage, site)
        if key not in self._site_order:
            sites = sorted({s for (st, s) in self._buckets if st == stage})
            size = self.cost.activation_bytes

            def site_cost(s: int) -> float:
                return self.swarm.latency_s[site][s] + size / self.swarm.bandwidth_Bps[site][s]

            self._site_order[key] = sorted(sites, key=lambda s: (site_cost(s), s))
        return self._site_order[key]
