"""SkipPipe with group paths: each data node sends its microbatches down a few fixed partial paths.

The authors' scheduler plans *groups*, not microbatches: one path per group of a data node's
microbatches, so at the paper's setting (5 data nodes x 3 block visits = 15 block nodes) its paths
are node-disjoint partial pipelines and every block node serves one data node. That removes the
cross-traffic the per-microbatch planner has to queue around. This module searches such path sets:
`groups` paths per data node, every block stage on exactly the same number of paths (so every stage
still sees the same share of the data), nodes of a stage spread over its paths (disjoint while the
stage has enough nodes). A random legal start is improved by a local search (exchange a stage's
nodes between paths, exchange stages between paths, toggle an adjacent swap, exchange two paths'
data nodes), each candidate timed by `route_timing.time_routes`; the shortest makespan is kept.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from shoal.planning.costs import CostModel
from shoal.planning.paths import path_violation, stage_moves
from shoal.planning.plan import IterationPlan
from shoal.planning.route_timing import list_schedule_routes, time_routes
from shoal.planning.swarm import NodeId, Swarm

_Paths = list[list[NodeId]]  # one list of block-stage nodes per path, in visit order


def group_counts(swarm: Swarm, microbatches: int, visits: int, max_groups: int = 3) -> list[int]:
    """Paths per data node that keep stage visits equal: g with g | k (k microbatches per data node)
    and (data nodes x g x visits) divisible by the block stages. Empty when the data nodes' shares differ."""
    data = len(swarm.data_nodes)
    if data == 0 or microbatches % data:
        return []
    k = microbatches // data
    return [g for g in range(1, min(k, max_groups) + 1) if k % g == 0 and (data * g * visits) % (swarm.stages - 1) == 0]


def jumps_ok(stage_seq: Sequence[int], max_jump: int | None) -> bool:
    """No hop goes more than `max_jump` stages past the highest stage visited before it."""
    if max_jump is None:
        return True
    frontier = 0
    for s in stage_seq:
        if s > frontier + max_jump:
            return False
        frontier = max(frontier, s)
    return True


def plan_group_paths(
    swarm: Swarm,
    cost: CostModel,
    microbatches: int,
    visits: int,
    groups: int,
    max_swaps: int,
    max_jump: int | None,
    evaluations: int,
    rng: random.Random,
    restarts: int = 4,
) -> IterationPlan | None:
    """The best group-path plan the search finds in `evaluations` timings; None if no legal start exists."""
    data = [n.node_id for n in swarm.data_nodes]
    per_origin = microbatches // len(data)
    origins = [o for o in data for _ in range(groups)]
    search = _Search(swarm, cost, visits, max_swaps, max_jump, rng)
    counts = dict.fromkeys(data, per_origin)

    def timed(candidate: _Paths, owners: list[NodeId], timer=list_schedule_routes) -> IterationPlan:
        by_origin: dict[NodeId, list[tuple[NodeId, ...]]] = {o: [] for o in data}
        for owner, hops in zip(owners, candidate, strict=True):
            by_origin[owner].append(tuple(hops))
        return timer(swarm, cost, by_origin, counts)

    best: tuple[IterationPlan, _Paths, list[NodeId]] | None = None
    per_start = max(1, evaluations // max(1, restarts))
    for _ in range(max(1, restarts)):
        paths = search.start(len(origins))
        if paths is None:
            return None
        owners = list(origins)
        plan = timed(paths, owners)
        current = _span(plan)
        if best is None or current < _span(best[0]) - 1e-9:
            best = (plan, paths, owners)
        for _ in range(per_start - 1):
            moved = search.neighbour(paths, owners)
            if moved is None:
                continue
            plan = timed(*moved)
            span = _span(plan)
            if span <= current + 1e-9:  # sideways moves too: the landscape has wide plateaus
                (paths, owners), current = moved, span
                if span < _span(best[0]) - 1e-9:
                    best = (plan, paths, owners)
    assert best is not None
    booked = timed(best[1], best[2], time_routes)  # the other timing of the same paths, if shorter
    return booked if _span(booked) < _span(best[0]) - 1e-9 else best[0]


def _span(plan: IterationPlan) -> float:
    span = plan.predicted_makespan_s
    assert span is not None
    return span


class _Search:
    def __init__(
        self, swarm: Swarm, cost: CostModel, visits: int, max_swaps: int, max_jump: int | None, rng: random.Random
    ) -> None:
        self.swarm, self.cost, self.visits = swarm, cost, visits
        self.max_swaps, self.max_jump, self.rng = max_swaps, max_jump, rng
        self.stage_of = {n.node_id: n.stage for n in swarm.nodes}

    def legal(self, hops: Sequence[NodeId]) -> bool:
        seq = [self.stage_of[h] for h in hops]
        return path_violation(seq, self.swarm.stages, self.visits, self.max_swaps) is None and jumps_ok(
            seq, self.max_jump
        )

    def start(self, n_paths: int) -> _Paths | None:
        """Random legal stage sequences with every block stage on equally many paths, then each stage's
        nodes dealt over its paths (least used first, so disjoint while the stage has enough nodes)."""
        stages = self.swarm.stages
        per_stage = n_paths * self.visits // (stages - 1)
        quota = [0] + [per_stage] * (stages - 1)
        seqs: list[list[int]] = []
        for remaining in range(n_paths, 0, -1):
            frontier, pending, swaps, seq = 0, None, 0, []
            for left in range(self.visits, 0, -1):
                moves = stage_moves(frontier, pending, swaps, left, quota, remaining, self.max_jump, self.max_swaps)
                if not moves:
                    return None
                stage, frontier, pending, swaps = self.rng.choice(moves)
                seq.append(stage)
                quota[stage] -= 1
            seqs.append(seq)
        used = {n.node_id: 0 for n in self.swarm.nodes}
        paths: _Paths = []
        for seq in seqs:
            hops = []
            for stage in seq:
                group = self.swarm.by_stage[stage]
                low = min(used[n.node_id] for n in group)
                pick = self.rng.choice([n for n in group if used[n.node_id] == low]).node_id
                used[pick] += 1
                hops.append(pick)
            paths.append(hops)
        return paths

    def neighbour(self, paths: _Paths, origins: list[NodeId]) -> tuple[_Paths, list[NodeId]] | None:
        """One random move, or None when the drawn move is not legal here."""
        rng = self.rng
        new = [list(p) for p in paths]
        owners = list(origins)
        kind = rng.random()
        a = rng.randrange(len(new))
        if kind < 0.45:  # give a hop of path a to another node of its stage (exchanging if that node is on a path)
            i = rng.randrange(self.visits)
            node = new[a][i]
            other = rng.choice(self.swarm.by_stage[self.stage_of[node]]).node_id
            if other == node:
                return None
            for p in new:
                for j, h in enumerate(p):
                    if h == other:
                        p[j] = node
            new[a][i] = other
        elif kind < 0.75:  # exchange one stage between two paths (each keeps its count of stage visits)
            b = rng.randrange(len(new))
            sa = {self.stage_of[h]: h for h in new[a]}
            sb = {self.stage_of[h]: h for h in new[b]}
            only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
            if a == b or not only_a or not only_b:
                return None
            s, t = rng.choice(only_a), rng.choice(only_b)
            new[a] = sorted([h for h in new[a] if h != sa[s]] + [sb[t]], key=self.stage_of.__getitem__)
            new[b] = sorted([h for h in new[b] if h != sb[t]] + [sa[s]], key=self.stage_of.__getitem__)
        elif kind < 0.9:  # toggle an adjacent swap: visit two neighbouring stages in the other order
            i = rng.randrange(self.visits - 1) if self.visits > 1 else 0
            if self.visits < 2 or abs(self.stage_of[new[a][i]] - self.stage_of[new[a][i + 1]]) != 1:
                return None
            new[a][i], new[a][i + 1] = new[a][i + 1], new[a][i]
        else:  # two paths trade data nodes
            b = rng.randrange(len(new))
            if owners[a] == owners[b]:
                return None
            owners[a], owners[b] = owners[b], owners[a]
        if not all(self.legal(p) for p in new):
            return None
        return new, owners
