"""DT-FM's allocation and pipelines: bottleneck matching, the search, the fixed pipelines."""

from __future__ import annotations

import random
from itertools import permutations

import pytest

from shoal.planning.allocation import _objective, allocate_stages
from shoal.planning.costs import CostModel
from shoal.planning.dtfm import plan_dtfm
from shoal.planning.links import LinkTable
from shoal.planning.matching import bottleneck_matching
from shoal.planning.swarm import PlanNode, Swarm


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 3), (3, 5), (4, 7), (6, 8)])
def test_bottleneck_matching_matches_brute_force(rows, cols):
    rng = random.Random(rows * 10 + cols)
    for _ in range(20):
        weights = [[rng.choice([1.0, 2.0, 3.0, rng.random() * 5]) for _ in range(cols)] for _ in range(rows)]
        value, assignment = bottleneck_matching(weights)
        brute = min(max(weights[r][c] for r, c in enumerate(p)) for p in permutations(range(cols), rows))
        assert value == pytest.approx(brute)
        assert len(set(assignment)) == rows
        assert max(weights[r][c] for r, c in enumerate(assignment)) == pytest.approx(value)


def _clustered_swarm() -> Swarm:
    """Three continents far apart, six nodes in each, placed round-robin like the authors' runs."""
    sites = 3
    lat = tuple(tuple(0.002 if a == b else 0.120 for b in range(sites)) for a in range(sites))
    bw = tuple(tuple(1e9 if a == b else 1e7 for b in range(sites)) for a in range(sites))
    nodes = tuple(PlanNode(i, 0, i % sites, 1.0, 3) for i in range(18))
    return Swarm(nodes, 6, lat, bw)


def test_allocation_keeps_sizes_and_beats_random_allocations():
    swarm, cost = _clustered_swarm(), CostModel(activation_bytes=32 * 2**20)
    sizes = [3, 3, 3, 3, 3, 3]
    result = allocate_stages(swarm, cost, sizes, random.Random(0))
    counts = [sum(1 for s in result.stage_of.values() if s == k) for k in range(6)]
    assert counts == sizes
    rng = random.Random(1)
    links = LinkTable.build(swarm, cost, sorted(swarm.nodes, key=lambda n: n.node_id))
    for _ in range(20):
        order = list(range(18))
        rng.shuffle(order)
        parts = [sorted(order[3 * s : 3 * s + 3]) for s in range(6)]
        assert result.cost <= _objective(parts, links)[0] + 1e-9
    # the cheapest pipelines stay inside one continent: every pipeline is one site throughout
    for pipeline in result.pipelines:
        assert len({swarm.node(n).site for n in pipeline}) == 1


def test_dtfm_plan_sends_every_microbatch_through_every_stage_of_a_fixed_pipeline():
    swarm, cost = _clustered_swarm(), CostModel(activation_bytes=32 * 2**20)
    allocation = allocate_stages(swarm, cost, [3] * 6, random.Random(0))
    plan = plan_dtfm(swarm.with_stages(allocation.stage_of), cost, 30)
    assert len(plan.routes) == 30
    pipelines = {(r.origin, r.hops) for r in plan.routes}
    assert len(pipelines) == 3
    for route in plan.routes:
        assert route.stages(plan.swarm) == (1, 2, 3, 4, 5)
        assert plan.swarm.node(route.origin).stage == 0
    assert sorted(sum(1 for r in plan.routes if (r.origin, r.hops) == p) for p in pipelines) == [10, 10, 10]
