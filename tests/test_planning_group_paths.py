"""Group paths (a few fixed paths per data node) and the two ways of timing fixed routes."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from itertools import pairwise

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.group_paths import group_counts, jumps_ok, plan_group_paths
from shoal.planning.paths import plan_violations
from shoal.planning.plan import IterationPlan
from shoal.planning.route_timing import list_schedule_routes, time_routes
from shoal.planning.skippipe import SkipPipeOptions, plan_skippipe
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.replay import simulate_plan

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)


def paper_like_swarm(seed: int) -> Swarm:
    """20 nodes, stages [5, 3, 3, 3, 3, 3], memory 3, random links over 6 sites."""
    rng = random.Random(seed)
    sizes = [5, 3, 3, 3, 3, 3]
    stage_of = [s for s, n in enumerate(sizes) for _ in range(n)]
    sites = 6
    nodes = tuple(PlanNode(i, stage_of[i], rng.randrange(sites), 1.76, 3) for i in range(len(stage_of)))
    lat = tuple(tuple(0.001 if a == b else rng.uniform(0.005, 0.15) for b in range(sites)) for a in range(sites))
    bw = tuple(tuple(2e9 if a == b else rng.uniform(1e7, 3e8) for b in range(sites)) for a in range(sites))
    return Swarm(nodes, 6, lat, bw)


def _check_timetable(plan: IterationPlan) -> None:
    """No two tasks overlap on a node, and no node holds more than its memory (forward start to backward end)."""
    swarm = plan.swarm
    busy, held = defaultdict(list), defaultdict(list)
    for route, t in zip(plan.routes, plan.timings, strict=True):
        o = swarm.node(route.origin)
        busy[o.node_id] += [
            (t.release_s, t.release_s + o.forward_s),
            (t.head_s, t.head_s + COST.head_s(o)),
            (t.origin_backward_s, t.end_s),
        ]
        held[o.node_id].append((t.release_s, t.end_s))
        for h, f, b in zip(route.hops, t.forward_s, t.backward_s, strict=True):
            n = swarm.node(h)
            assert f < b
            busy[h] += [(f, f + n.forward_s), (b, b + COST.backward_s(n))]
            held[h].append((f, b + COST.backward_s(n)))
    for spans in busy.values():
        spans.sort()
        for (_, end), (start, _) in pairwise(spans):
            assert start >= end - 1e-9
    for node, spans in held.items():
        for s, _ in spans:
            assert sum(1 for s2, e2 in spans if s2 <= s + 1e-9 and e2 > s + 1e-9) <= swarm.node(node).memory


def test_group_counts_keep_stage_visits_equal():
    swarm = paper_like_swarm(0)
    assert group_counts(swarm, 30, 3) == [1, 2, 3]  # 5 x g x 3 is always a multiple of 5
    assert group_counts(swarm, 31, 3) == []  # unequal shares per data node
    assert group_counts(swarm, 10, 4) == [1, 2]  # k = 2: g must divide it


def test_jumps_ok():
    assert jumps_ok([1, 5, 4], 4) and not jumps_ok([5, 4, 3], 4) and jumps_ok([5, 4, 3], None)


@pytest.mark.parametrize("timer", [time_routes, list_schedule_routes])
def test_fixed_routes_are_timed_validly_and_realised_exactly_by_the_simulator(timer):
    swarm = paper_like_swarm(1)
    paths = {0: [(5, 8, 11)], 1: [(6, 9, 14)], 2: [(7, 12, 15)], 3: [(10, 13, 16)], 4: [(17, 18, 19)]}
    plan = timer(swarm, COST, paths, dict.fromkeys(paths, 6))
    assert Counter(r.origin for r in plan.routes) == Counter(dict.fromkeys(paths, 6))
    assert all((r.hops,) == tuple(paths[r.origin]) for r in plan.routes)
    _check_timetable(plan)
    result = simulate_plan(plan, COST)
    assert result.completed == 30
    assert result.makespan_s == pytest.approx(plan.predicted_makespan_s)


@pytest.mark.parametrize("seed", range(3))
def test_group_paths_follow_the_rules_and_are_node_disjoint_at_the_papers_shape(seed):
    swarm = paper_like_swarm(seed)
    plan = plan_group_paths(swarm, COST, 30, 3, 1, 2, 4, 200, random.Random(seed))
    assert plan is not None
    assert plan_violations(plan, 3, 2) == []
    _check_timetable(plan)
    per_origin = {r.origin: r.hops for r in plan.routes}
    assert all(r.hops == per_origin[r.origin] for r in plan.routes), "one path per data node"
    used = [h for hops in per_origin.values() for h in hops]
    assert len(used) == len(set(used)) == 15, "5 paths x 3 hops cover the 15 block nodes once"
    assert all(jumps_ok([swarm.node(h).stage for h in hops], 4) for hops in per_origin.values())


def test_skippipe_keeps_the_shorter_of_per_microbatch_and_group_plans():
    swarm = paper_like_swarm(4)
    base = SkipPipeOptions(skip=0.33, max_swaps=2, max_jump=4, search_budget=60)
    without = plan_skippipe(swarm, COST, 30, SkipPipeOptions(**{**base.__dict__, "group_search": 0}), random.Random(0))
    with_groups = plan_skippipe(swarm, COST, 30, base, random.Random(0))
    assert with_groups.predicted_makespan_s <= without.predicted_makespan_s + 1e-9
    assert plan_violations(with_groups, 3, 2) == []
