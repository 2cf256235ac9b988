"""GWTF flow routing, churn decisions, and SWARM's balancer, on small swarms checked by hand."""

from __future__ import annotations

import random
from collections import Counter

from shoal.planning.costs import CostModel
from shoal.planning.from_view import swarm_from_view
from shoal.planning.gwtf import FlowPlan, _FlowState, hop_cost, pick_route, plan_flows
from shoal.planning.plan import Route
from shoal.planning.recovery import detour_if_full, place_joining_node, replacement_node
from shoal.planning.swarm import PlanNode, Swarm
from shoal.planning.swarm_routing import SwarmBalancer, swarm_join_stage
from shoal.planning.swarm_view import NodeInfo as ViewNode
from shoal.planning.swarm_view import SwarmView

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)
SITES = 3
LAT = tuple(tuple(0.001 if a == b else 0.1 * (1 + abs(a - b)) for b in range(SITES)) for a in range(SITES))
BW = tuple(tuple(2e9 if a == b else 1e7 for b in range(SITES)) for a in range(SITES))


def _swarm(nodes) -> Swarm:
    return Swarm(tuple(nodes), 4, LAT, BW)


def _random_swarm(seed: int) -> Swarm:
    rng = random.Random(seed)
    nodes = [PlanNode(i, i % 4, rng.randrange(SITES), rng.uniform(0.5, 3), rng.randint(1, 4)) for i in range(16)]
    return _swarm(nodes)


def test_flow_routes_are_full_pipelines_within_every_nodes_capacity():
    for seed in range(5):
        swarm = _random_swarm(seed)
        plan = plan_flows(swarm, COST, random.Random(seed), anneal_steps=300)
        assert plan.routes, "there is capacity for at least one route"
        load = Counter(n for r in plan.routes for n in (r.origin, *r.hops))
        for node, used in load.items():
            assert used <= swarm.node(node).memory
        for r in plan.routes:
            assert swarm.node(r.origin).stage == 0 and r.stages(swarm) == (1, 2, 3)


def test_annealing_never_returns_a_worse_worst_route_than_the_greedy_start():
    for seed in range(5):
        swarm = _random_swarm(seed)
        greedy = plan_flows(swarm, COST, random.Random(seed), anneal_steps=0)
        annealed = plan_flows(swarm, COST, random.Random(seed), anneal_steps=500)
        assert annealed.max_time_s <= greedy.max_time_s + 1e-9
        assert len(annealed.routes) == len(greedy.routes)


def test_routes_prefer_the_near_replica_and_move_off_a_node_only_by_capacity():
    # data node at site 0; stage 1 has a near and a far replica, each with room for one route
    d = PlanNode(0, 0, 0, 1.0, 2)
    near, far = PlanNode(1, 1, 0, 1.0, 1), PlanNode(2, 1, 2, 1.0, 1)
    s2, s3 = PlanNode(3, 2, 0, 1.0, 2), PlanNode(4, 3, 0, 1.0, 2)
    swarm = _swarm([d, near, far, s2, s3])
    state = _FlowState(swarm, COST)
    first = state.cheapest_route(d)
    assert first is not None and first.hops == (1, 3, 4)
    plan = plan_flows(swarm, COST, random.Random(0), anneal_steps=100)
    assert sorted(r.hops[0] for r in plan.routes) == [1, 2]  # the second route must take the far one


def test_every_data_node_gets_routes_and_they_spread_over_a_stages_replicas():
    # four data nodes and two equal replicas of each block stage at one site: the cheapest links alone
    # sent every route through the lowest-numbered replicas, stopped at 3 routes once those were busy
    # (a 4th through them added nothing), and left the 4th data node no route at all
    data = [PlanNode(i, 0, 0, 0.015, 16) for i in range(4)]
    blocks = [PlanNode(4 + 2 * (stage - 1) + k, stage, 0, 0.018, 16) for stage in (1, 2) for k in range(2)]
    swarm = Swarm(tuple(data + blocks), 3, ((0.0005,),), ((1e9,),))
    plan = plan_flows(swarm, CostModel(activation_bytes=256 * 1024), random.Random(0))
    assert {r.origin for r in plan.routes} == {0, 1, 2, 3}
    load = Counter(h for r in plan.routes for h in r.hops)
    assert set(load) == {b.node_id for b in blocks} and max(load.values()) - min(load.values()) <= 1, load


def test_a_lost_hop_goes_to_the_cheapest_live_replica_with_room():
    prev, nxt = PlanNode(0, 0, 0, 1.0, 3), PlanNode(9, 2, 0, 1.0, 3)
    dead, near, far = PlanNode(1, 1, 0, 1.0, 3), PlanNode(2, 1, 0, 1.5, 3), PlanNode(3, 1, 2, 1.0, 3)
    swarm = _swarm([prev, nxt, dead, near, far])
    assert replacement_node(swarm, COST, 1, prev, nxt, exclude={1}).node_id == 2
    # a full replica is passed over while another has room
    assert replacement_node(swarm, COST, 1, prev, nxt, exclude={1}, load={2: 3}).node_id == 3
    assert replacement_node(swarm, COST, 1, prev, nxt, exclude={1, 2, 3}) is None
    expected = hop_cost(swarm, COST, prev, near) + hop_cost(swarm, COST, near, nxt)
    assert expected < hop_cost(swarm, COST, prev, far) + hop_cost(swarm, COST, far, nxt)


def test_a_joining_node_strengthens_the_bottleneck_stage():
    # stage 2 has a single slow replica; the others have three fast ones
    nodes = [PlanNode(0, 0, 0, 1.0, 6), PlanNode(1, 0, 0, 1.0, 6), PlanNode(2, 2, 0, 6.0, 1)]
    nodes += [PlanNode(10 * s + i, s, 0, 1.0, 3) for s in (1, 3) for i in range(3)]
    swarm = _swarm(nodes)
    newcomer = PlanNode(99, 1, 0, 1.0, 3)
    assert place_joining_node(swarm, COST, newcomer) == 2
    assert swarm_join_stage(swarm, COST, newcomer) == 2


def test_swarm_balancer_spreads_by_measured_speed_and_drops_failed_peers():
    rng = random.Random(0)
    balancer = SwarmBalancer(initial_s=1.0)
    balancer.observe(1, 1.0)
    balancer.observe(2, 4.0)
    picks = Counter(balancer.choose([1, 2], rng) for _ in range(50))
    assert picks[1] == 40 and picks[2] == 10  # four times faster, four times as many requests
    balancer.forget(1)
    base = balancer.load[2]
    pick = balancer.choose([2, 3], rng)  # a new peer enters at the lowest load, level with peer 2
    assert set(balancer.load) == {2, 3}
    assert balancer.load[5 - pick] == base
    assert balancer.load[pick] == base + balancer.seconds_per_task.get(pick, 1.0)


def test_a_full_planned_hop_is_swapped_for_the_cheapest_replica_with_room():
    prev, nxt = PlanNode(0, 0, 0, 1.0, 3), PlanNode(9, 2, 0, 1.0, 3)
    planned, near, far = PlanNode(1, 1, 0, 1.0, 2), PlanNode(2, 1, 0, 1.0, 2), PlanNode(3, 1, 2, 1.0, 2)
    swarm = _swarm([prev, nxt, planned, near, far])
    assert detour_if_full(swarm, COST, 1, prev, planned, nxt, {1: 1}) is planned  # it still has room
    assert detour_if_full(swarm, COST, 1, prev, planned, nxt, {1: 2}) is near
    assert detour_if_full(swarm, COST, 1, prev, planned, nxt, {1: 2, 2: 2}) is far
    assert detour_if_full(swarm, COST, 1, prev, planned, nxt, {1: 2, 2: 2, 3: 2}) is planned  # all full: wait


def test_the_daemons_view_becomes_a_planning_swarm_with_measured_links():
    view = SwarmView(
        "run",
        3,
        (0, 2, 2),
        (
            ViewNode("d", "data", 0, "active", 4.0, 3),
            ViewNode("a", "worker", 1, "active", 10.0, 4),
            ViewNode("b", "worker", 2, "leaving", 10.0, 4),
            ViewNode("c", "worker", 2, "active", 5.0, 2),
        ),
    )
    swarm, ids = swarm_from_view(view, COST, {("d", "a"): (0.02, 1e8)})
    assert set(ids) == {"a", "c", "d"}  # a leaving peer is not planned on
    a, c, d = (swarm.node(ids[p]) for p in "acd")
    assert a.forward_s == 2 / 10.0 / 2.5 and c.forward_s == 2 / 5.0 / 2.5 and c.memory == 2
    assert swarm.latency(d, a) == swarm.latency(a, d) == 0.02 and swarm.bandwidth(a, d) == 1e8
    assert swarm.latency(a, c) == 0.1  # unmeasured: the stated default
    assert plan_flows(swarm, COST, random.Random(0), anneal_steps=10).routes


def test_a_data_node_sends_its_next_microbatch_where_it_should_finish_first():
    fast, slow = Route(0, (1, 2, 3)), Route(0, (4, 5, 6))
    plan = FlowPlan((fast, slow, Route(7, (1, 5, 3))), (10.0, 20.0, 15.0))
    assert pick_route(plan, 0, {}) == fast
    assert pick_route(plan, 0, {(0, fast.hops): 1}) == fast  # 2 x 10 = 20 ties 1 x 20: the first in order
    assert pick_route(plan, 0, {(0, fast.hops): 2}) == slow  # 3 x 10 > 20
    assert pick_route(plan, 9, {}) is None  # a data node without planned routes waits


def test_a_data_node_that_joins_a_swarm_whose_routes_fill_every_replica_still_gets_one():
    """Re-planned from the first data node's routes, which take every worker's room, the newcomer got
    no route and abandoned every microbatch after the stage wait (seen in the daemon). Its first route
    now queues behind the others' instead."""
    first = PlanNode(0, 0, 0, 1.0, 4)
    workers = [PlanNode(1, 1, 0, 1.0, 2), PlanNode(2, 2, 0, 1.0, 2)]
    alone = Swarm((first, *workers), 3, ((0.001,),), ((1e9,),))
    before = plan_flows(alone, COST, random.Random(0), anneal_steps=50)
    assert len(before.routes) == 2  # the workers' room, all the first data node's
    second = PlanNode(3, 0, 0, 1.0, 4)
    joined = Swarm((first, *workers, second), 3, ((0.001,),), ((1e9,),))
    after = plan_flows(joined, COST, random.Random(0), anneal_steps=5, keep=before.routes)
    assert {r.origin for r in after.routes} == {0, 3}
    assert pick_route(after, 3, {}) is not None
