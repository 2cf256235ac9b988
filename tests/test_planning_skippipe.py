"""SkipPipe's path rules and timetables, checked on every path of plans over random swarms."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from itertools import pairwise

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.paths import block_visits, path_violation, plan_violations, stage_moves, swap_count
from shoal.planning.plan import IterationPlan
from shoal.planning.random_skip import plan_random_skip
from shoal.planning.skippipe import SkipPipeOptions, microbatches_per_origin, plan_skippipe
from shoal.planning.swarm import PlanNode, Swarm

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)


def random_swarm(rng: random.Random, nodes: int, stages: int, sites: int = 5) -> Swarm:
    """Every stage non-empty, heterogeneous compute, memory and links (asymmetric latency too)."""
    stage_of = list(range(stages)) + [rng.randrange(stages) for _ in range(nodes - stages)]
    rng.shuffle(stage_of)
    members = tuple(
        PlanNode(
            i,
            stage_of[i],
            rng.randrange(sites),
            rng.uniform(0.5, 3.0),
            rng.randint(1, 4),
            rng.choice([float("inf"), rng.uniform(1e7, 1e9)]),
        )
        for i in range(nodes)
    )
    lat = tuple(tuple(0.001 if a == b else rng.uniform(0.005, 0.2) for b in range(sites)) for a in range(sites))
    bw = tuple(tuple(2e9 if a == b else rng.uniform(1e7, 3e8) for b in range(sites)) for a in range(sites))
    return Swarm(members, stages, lat, bw)


def test_block_visits_and_swaps_follow_the_paper():
    assert block_visits(6, 0.33) == 3  # 3 of 5 block stages, as in the authors' code
    assert block_visits(6, 0.25) == 4
    assert block_visits(6, 0.0) == 5
    assert swap_count([1, 2, 3]) == 0
    assert swap_count([2, 1, 4, 3]) == 2
    assert swap_count([1, 3, 2]) == 1
    assert swap_count([3, 1, 2]) is None  # a jump back over two stages
    assert swap_count([1, 4, 2]) is None  # 4 and 2 are not neighbours
    assert path_violation([1, 3, 2], 6, 3, max_swaps=0) is not None
    assert path_violation([1, 3, 2], 6, 3, max_swaps=1) is None
    assert path_violation([1, 1, 2], 6, 3, max_swaps=2) is not None
    assert path_violation([1, 2], 6, 3, max_swaps=2) is not None


def test_stage_moves_never_strand_a_mandatory_stage():
    # two paths left and stage 5 needs both of them: it cannot come first (nothing would follow it
    # on a 2-hop path), and whatever comes first, the second hop must be stage 5
    quota = [0, 0, 1, 1, 0, 2]
    first = [stage for stage, *_ in stage_moves(0, None, 0, 2, quota, 2, None, 0)]
    assert first == [2, 3]
    for stage in first:
        assert [s for s, *_ in stage_moves(stage, None, 0, 1, quota, 2, None, 0)] == [5]
    # one path left that must visit 1, 2 and 3: start at 1, or swap (2, 1) and leave 1 pending;
    # swapping (3, 2) first would skip stage 1 for good
    assert stage_moves(0, None, 0, 3, [0, 1, 1, 1, 0, 0], 1, None, 1) == [(1, 1, None, 0), (2, 2, 1, 1)]


def _tasks(plan: IterationPlan, cost: CostModel):
    """Every planned compute task as (node, start, end), and every residency as (node, start, end)."""
    swarm = plan.swarm
    busy, held = [], []
    for route, t in zip(plan.routes, plan.timings, strict=True):
        origin = swarm.node(route.origin)
        busy += [
            (origin.node_id, t.release_s, t.release_s + origin.forward_s),
            (origin.node_id, t.head_s, t.head_s + cost.head_s(origin)),
            (origin.node_id, t.origin_backward_s, t.end_s),
        ]
        held.append((origin.node_id, t.release_s, t.end_s))
        for h, f, b in zip(route.hops, t.forward_s, t.backward_s, strict=True):
            node = swarm.node(h)
            busy += [(h, f, f + node.forward_s), (h, b, b + cost.backward_s(node))]
            held.append((h, f, b + cost.backward_s(node)))
    return busy, held


def _check_causal(plan: IterationPlan, cost: CostModel) -> None:
    swarm = plan.swarm
    for route, t in zip(plan.routes, plan.timings, strict=True):
        chain = [swarm.node(route.origin)] + [swarm.node(h) for h in route.hops] + [swarm.node(route.origin)]
        starts = [t.release_s, *t.forward_s, t.head_s]
        durations = [n.forward_s for n in chain[:-1]] + [cost.head_s(chain[-1])]
        for i in range(1, len(starts)):
            ready = starts[i - 1] + durations[i - 1] + cost.transfer_s(swarm, chain[i - 1], chain[i])
            assert starts[i] >= ready - 1e-9, "a forward starts before its input can have arrived"
        back = [t.head_s, *reversed(t.backward_s), t.origin_backward_s]
        back_nodes = [chain[-1], *reversed(chain[1:-1]), chain[0]]
        back_durations = [cost.head_s(chain[-1])] + [cost.backward_s(n) for n in back_nodes[1:]]
        for i in range(1, len(back)):
            ready = back[i - 1] + back_durations[i - 1] + cost.transfer_s(swarm, back_nodes[i - 1], back_nodes[i])
            assert back[i] >= ready - 1e-9, "a backward starts before its gradient can have arrived"


@pytest.mark.parametrize("seed", range(12))
def test_every_skippipe_path_obeys_the_rules_on_random_swarms(seed):
    rng = random.Random(seed)
    stages = rng.randint(3, 7)
    swarm = random_swarm(rng, rng.randint(stages + 2, 24), stages)
    skip = rng.choice([0.0, 0.25, 0.33, 0.5])
    swaps = rng.choice([0, 1, 2])
    microbatches = rng.randint(1, 40)
    visits = block_visits(stages, skip)
    for aware in (True, False):
        options = SkipPipeOptions(skip=skip, max_swaps=swaps, collision_aware=aware, search_budget=3 * microbatches)
        plan = plan_skippipe(swarm, COST, microbatches, options, random.Random(seed))
        assert len(plan.routes) == microbatches
        assert plan_violations(plan, visits, swaps) == []
        per_origin = Counter(r.origin for r in plan.routes)
        assert per_origin == Counter({k: v for k, v in microbatches_per_origin(swarm, microbatches).items() if v})
        if not aware:
            assert plan.timings is None
            continue
        busy, held = _tasks(plan, COST)
        by_node = defaultdict(list)
        for node, start, end in busy:
            by_node[node].append((start, end))
        for node, spans in by_node.items():
            spans.sort()
            for (_, end), (start, _) in pairwise(spans):
                assert start >= end - 1e-9, f"two microbatches overlap on node {node}"
        for node in {n for n, _, _ in held}:
            spans = [(s, e) for n, s, e in held if n == node]
            for s, _ in spans:  # concurrency is highest right after some admission
                inside = sum(1 for s2, e2 in spans if s2 <= s + 1e-9 and e2 > s + 1e-9)
                assert inside <= swarm.node(node).memory, f"node {node} holds more than its memory"
        _check_causal(plan, COST)
        assert plan.predicted_makespan_s == max(t.end_s for t in plan.timings) - min(t.release_s for t in plan.timings)


@pytest.mark.parametrize("seed", range(6))
def test_random_skip_paths_obey_the_same_rules(seed):
    rng = random.Random(100 + seed)
    stages = rng.randint(3, 7)
    swarm = random_swarm(rng, rng.randint(stages + 2, 24), stages)
    skip = rng.choice([0.25, 0.33, 0.5])
    plan = plan_random_skip(swarm, 30, skip, random.Random(seed))
    assert plan_violations(plan, block_visits(stages, skip), max_swaps=0) == []
    loads = Counter(h for r in plan.routes for h in r.hops)
    for group in swarm.by_stage[1:]:
        counts = [loads[n.node_id] for n in group]
        assert max(counts) - min(counts) <= 1, "random skipping still spreads a stage's visits evenly"


def test_search_budget_only_ever_keeps_a_better_plan():
    rng = random.Random(3)
    swarm = random_swarm(rng, 16, 5)
    once = plan_skippipe(swarm, COST, 20, SkipPipeOptions(search_budget=20))
    searched = plan_skippipe(swarm, COST, 20, SkipPipeOptions(search_budget=200), random.Random(1))
    assert searched.predicted_makespan_s <= once.predicted_makespan_s + 1e-9
