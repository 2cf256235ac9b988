"""DT-FM's allocation and pipelines: bottleneck matching, the search, the fixed pipelines."""

from __future__ import annotations

import random
from itertools import permutations

import numpy as np
import pytest

from shoal.planning import allocation
from shoal.planning.allocation import _apply, _random_move, allocate_stages
from shoal.planning.banded_start import banded_start, stage_orders
from shoal.planning.costs import CostModel
from shoal.planning.dtfm import plan_dtfm
from shoal.planning.dtfm_objective import Memo, objective
from shoal.planning.links import LinkTable
from shoal.planning.matching import bottleneck_matching
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.run import RunSpec, simulate

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)


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
        assert result.cost <= objective(parts, links)[0] + 1e-9
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


def _previous_bottleneck(weights: list[list[float]]) -> float:
    """The search this module used before: binary search over the weights, Kuhn's matching at each."""
    rows, cols = len(weights), len(weights[0])

    def feasible(limit: float) -> bool:
        owner = [-1] * cols

        def augment(r: int, seen: list[bool]) -> bool:
            for c in range(cols):
                if weights[r][c] <= limit and not seen[c]:
                    seen[c] = True
                    if owner[c] < 0 or augment(owner[c], seen):
                        owner[c] = r
                        return True
            return False

        return all(augment(r, [False] * cols) for r in range(rows))

    thresholds = sorted({w for row in weights for w in row})
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(thresholds[mid]) else (mid + 1, hi)
    return thresholds[hi]


@pytest.mark.parametrize("seed", range(6))
def test_bottleneck_matching_equals_the_previous_search_on_larger_matrices(seed):
    rng = random.Random(seed)
    for _ in range(15):
        rows = rng.randint(6, 40)
        cols = rng.randint(rows, 60)
        ties = rng.random() < 0.5  # structured delays repeat values a lot
        weights = [[float(rng.randint(1, 6)) if ties else rng.random() for _ in range(cols)] for _ in range(rows)]
        value, assignment = bottleneck_matching(weights)
        assert value == _previous_bottleneck(weights)
        assert len(set(assignment)) == rows
        assert max(weights[r][c] for r, c in enumerate(assignment)) == value
        assert bottleneck_matching(np.array(weights)) == (value, assignment)  # a function of the weights alone


def _sited_swarm(seed: int, nodes: int, stages: int, sites: int = 5) -> Swarm:
    rng = random.Random(seed)
    members = tuple(
        PlanNode(i, 0, rng.randrange(sites), 1.0, 3, rng.choice([float("inf"), rng.uniform(5e7, 1e9)]))
        for i in range(nodes)
    )
    lat = tuple(tuple(0.001 if a == b else rng.uniform(0.005, 0.15) for b in range(sites)) for a in range(sites))
    bw = tuple(tuple(2e9 if a == b else rng.uniform(1e7, 3e8) for b in range(sites)) for a in range(sites))
    return Swarm(members, stages, lat, bw)


@pytest.mark.parametrize(
    "sizes",
    [
        [20, 12, 12, 11, 13, 12],  # a smaller stage prunes chains, a larger one leaves a node out
        [6, 10, 10, 10],  # more chains than data nodes
        [3, 3, 3, 3],  # enumeration sizes
    ],
)
def test_memoised_objective_equals_a_fresh_one_after_random_moves(sizes):
    swarm = _sited_swarm(len(sizes), sum(sizes), len(sizes))
    links = LinkTable.build(swarm, COST, sorted(swarm.nodes, key=lambda n: n.node_id))
    rng = random.Random(7)
    order = list(range(sum(sizes)))
    rng.shuffle(order)
    parts = [sorted(order[sum(sizes[:s]) : sum(sizes[: s + 1])]) for s in range(len(sizes))]
    memos = [Memo(), Memo(limit=300)]  # the second forgets everything every few moves
    for _ in range(60):
        parts = _apply(parts, _random_move(parts, rng))
        fresh = objective(parts, links)
        for memo in memos:
            assert objective(parts, links, memo) == fresh
        value, chains = fresh
        assert sorted(c[0] for c in chains) == sorted(set(c[0] for c in chains))
        for chain in chains:
            assert [s for i in chain for s, part in enumerate(parts) if i in part] == list(range(len(sizes)))


def test_banded_start_fills_every_stage_to_its_size():
    for seed, sizes in enumerate([[25, 11, 11, 11, 10, 10], [6, 10, 10, 10], [40, 20, 20], [9, 9, 9, 9, 9]]):
        swarm = _sited_swarm(seed, sum(sizes), len(sizes), sites=7)
        links = LinkTable.build(swarm, COST, sorted(swarm.nodes, key=lambda n: n.node_id))
        strength = links.mean_transfer_s()
        for order in stage_orders(len(sizes)):
            assert sorted(order) == list(range(len(sizes)))
            parts = banded_start(links, sizes, order, strength)
            assert [len(p) for p in parts] == sizes
            assert sorted(i for p in parts for i in p) == list(range(sum(sizes)))


def test_large_swarm_search_is_deterministic_and_never_worse_than_its_starts(monkeypatch):
    monkeypatch.setattr(allocation, "CLIMB_WORK", 30_000)  # a short climb keeps the test fast
    sizes = [30, 18, 18, 17, 17]
    swarm = _sited_swarm(3, sum(sizes), len(sizes), sites=6)
    assert allocation._neighbourhood(sizes) > allocation.FULL_NEIGHBOURHOOD  # the banded path
    first = allocate_stages(swarm, COST, sizes, random.Random(4))
    again = allocate_stages(swarm, COST, sizes, random.Random(4))
    assert first == again
    parts = [sorted(n for n, s in first.stage_of.items() if s == k) for k in range(len(sizes))]  # ids = positions
    assert [len(p) for p in parts] == sizes
    links = LinkTable.build(swarm, COST, sorted(swarm.nodes, key=lambda n: n.node_id))
    value, chains = objective(parts, links)
    assert first.cost == value and first.pipelines == tuple(tuple(c) for c in chains)
    for order in stage_orders(len(sizes)):
        assert first.cost <= objective(banded_start(links, sizes, order, links.mean_transfer_s()), links)[0]
    for pipeline in first.pipelines:
        assert [first.stage_of[n] for n in pipeline] == list(range(len(sizes)))


def test_a_simulated_run_allocates_swarms_above_the_old_200_node_limit(monkeypatch):
    monkeypatch.setattr(allocation, "CLIMB_WORK", 20_000)
    result = simulate(RunSpec(scenario="random", nodes=220, stages=5, policy="dtfm", microbatches=8, seed=0))
    assert result.completed == 8
