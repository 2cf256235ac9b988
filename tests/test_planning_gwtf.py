"""GWTF's hop-by-hop decisions, churn decisions, and SWARM's balancer, on small swarms checked by hand."""

from __future__ import annotations

import random
from collections import Counter

from shoal.planning.costs import CostModel
from shoal.planning.flow_estimate import _GreedyRoutes
from shoal.planning.from_view import swarm_from_view
from shoal.planning.gwtf import (
    ANNEAL_DECISIONS,
    NeighbourTable,
    arrival_s,
    choose_next_hop,
    hop_cost,
    onward_s,
    unloaded_onward_s,
)
from shoal.planning.recovery import place_joining_node, replacement_node
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
    assert choose_next_hop(swarm, COST, d, 2, NeighbourTable(), random.Random(0), d.node_id) == c.node_id


def _greedy(rng, table, swarm, sender, stage):
    """A decision after the annealing has cooled: the cheapest arrival, nothing else."""
    table.decisions = 10 * ANNEAL_DECISIONS
    return choose_next_hop(swarm, COST, sender, stage, table, rng, 0)


def test_a_sender_takes_the_near_replica_until_its_answer_says_it_is_full():
    d = PlanNode(0, 0, 0, 1.0, 4)
    near, far = PlanNode(1, 1, 0, 1.0, 1), PlanNode(2, 1, 2, 1.0, 1)
    swarm = _swarm([d, near, far, PlanNode(3, 2, 0, 1.0, 4), PlanNode(4, 3, 0, 1.0, 4)])
    table, rng = NeighbourTable(), random.Random(0)
    assert _greedy(rng, table, swarm, d, 1) == 1
    assert _greedy(rng, table, swarm, d, 1) == 2  # the first send is not answered yet: near counts as full
    table.heard_from(1, 1, 3.0, 0)  # near answered: it holds one, all it can
    table.heard_from(2, 1, 3.0, 0)
    assert table.load_of(1) == 1 and table.unanswered[1] == 0
    assert _greedy(rng, table, swarm, d, 1) == 1  # both full: the cheaper link, to wait there
    table.heard_from(1, 2, 3.0, 0)
    table.returned(2)  # a gradient came back from far: it has room again, near still has none
    assert table.load_of(2) == 0
    assert _greedy(rng, table, swarm, d, 1) == 2


def test_the_onward_cost_travels_upstream_in_answers():
    # two replicas of stage 1; the one whose stage-2 neighbour is far from home reports a dearer way on
    d = PlanNode(0, 0, 0, 1.0, 4)
    a, b = PlanNode(1, 1, 0, 1.0, 4), PlanNode(2, 1, 0, 1.0, 4)
    s2 = PlanNode(3, 2, 0, 1.0, 4)
    s3 = PlanNode(4, 3, 0, 1.0, 4)
    swarm = _swarm([d, a, b, s2, s3])
    unloaded = unloaded_onward_s(swarm, COST, 0)
    assert unloaded[4] == hop_cost(swarm, COST, s3, d)
    assert unloaded[3] == hop_cost(swarm, COST, s2, s3) + unloaded[4]
    table = NeighbourTable()
    assert onward_s(swarm, COST, s3, table, 0) == unloaded[4]  # the last stage: the hop home
    # stage-2's node tells stage 1's what its queue costs, and stage 1's folds it into its own advert
    mine = NeighbourTable()
    mine.heard_from(3, 5, unloaded[3], 0)
    queued = onward_s(swarm, COST, a, mine, 0)
    assert queued == hop_cost(swarm, COST, a, s2) + 5 * COST.compute_s(s2) + unloaded[3]
    # the data node heard both replicas of stage 1: the one with the dearer way on loses
    table.heard_from(1, 0, queued, 0)
    table.heard_from(2, 0, unloaded[2], 0)
    assert arrival_s(swarm, COST, d, a, table, 0) > arrival_s(swarm, COST, d, b, table, 0)
    assert _greedy(random.Random(0), table, swarm, d, 1) == 2


def test_senders_who_never_talk_to_each_other_share_replicas_by_their_answers():
    """Four data nodes, two equal replicas per block stage, no plan anywhere: each replica answers
    with its true load, and the flows spread: within two of each other, since a sender learns a
    replica's load only by sending to it."""
    data = [PlanNode(i, 0, 0, 0.015, 16) for i in range(4)]
    blocks = [PlanNode(4 + 2 * (stage - 1) + k, stage, 0, 0.018, 16) for stage in (1, 2) for k in range(2)]
    swarm = Swarm(tuple(data + blocks), 3, ((0.0005,),), ((1e9,),))
    cost = CostModel(activation_bytes=256 * 1024)
    tables = {n.node_id: NeighbourTable() for n in swarm.nodes}
    held: Counter[int] = Counter()
    rng = random.Random(0)
    for _ in range(3):
        for sender in data:
            previous = sender
            for stage in (1, 2):
                table = tables[previous.node_id]
                table.decisions = 10 * ANNEAL_DECISIONS
                home = sender.node_id
                pick = choose_next_hop(swarm, cost, previous, stage, table, rng, home)
                held[pick] += 1
                answer = onward_s(swarm, cost, swarm.node(pick), tables[pick], home)
                table.heard_from(pick, held[pick], answer, home)
                previous = swarm.node(pick)
    assert set(held) == {b.node_id for b in blocks}
    for stage in (1, 2):
        loads = [held[b.node_id] for b in swarm.by_stage[stage]]
        assert max(loads) - min(loads) <= 2, held


def test_the_annealing_tries_a_near_equal_replica_while_warm_and_not_once_cold():
    d = PlanNode(0, 0, 0, 1.0, 100)
    better, worse = PlanNode(1, 1, 0, 1.0, 100), PlanNode(2, 1, 0, 1.05, 100)
    swarm = _swarm([d, better, worse, PlanNode(3, 2, 0, 1.0, 100), PlanNode(4, 3, 0, 1.0, 100)])

    def picks(table: NeighbourTable) -> Counter:
        rng, out = random.Random(0), Counter()
        for replica in (1, 2):
            table.heard_from(replica, 0, 1.0, 0)
        for _ in range(ANNEAL_DECISIONS):
            pick = choose_next_hop(swarm, COST, d, 1, table, rng, 0)
            table.heard_from(pick, 0, 1.0, 0)  # answers that leave the queues empty: only the annealing moves
            out[pick] += 1
        return out

    warm = picks(NeighbourTable())
    assert warm[2] > 0 and warm[1] > warm[2]
    cold = NeighbourTable()
    cold.decisions = ANNEAL_DECISIONS
    assert picks(cold)[2] == 0
    cold.warm_up(swarm)  # the swarm changed: it explores again
    assert cold.decisions == 0


def test_when_every_replica_is_full_a_sender_still_queues_at_one():
    """A data node that joins a swarm whose replicas the others fill must still get its microbatches
    in (seen in the daemon when it planned routes: it got none and abandoned every microbatch)."""
    d = PlanNode(0, 0, 0, 1.0, 4)
    swarm = Swarm((d, PlanNode(1, 1, 0, 1.0, 2), PlanNode(2, 2, 0, 1.0, 2)), 3, ((0.001,),), ((1e9,),))
    table = NeighbourTable()
    table.heard_from(1, 2, 1.0, 0)
    assert choose_next_hop(swarm, COST, d, 1, table, random.Random(0), 0) == 1
    assert choose_next_hop(swarm, COST, d, 1, table, random.Random(0), 0, exclude={1}) is None


def test_the_joiners_estimate_spreads_routes_over_replicas_and_serves_every_data_node():
    data = [PlanNode(i, 0, 0, 0.015, 16) for i in range(4)]
    blocks = [PlanNode(4 + 2 * (stage - 1) + k, stage, 0, 0.018, 16) for stage in (1, 2) for k in range(2)]
    swarm = Swarm(tuple(data + blocks), 3, ((0.0005,),), ((1e9,),))
    routes = _GreedyRoutes(swarm, CostModel(activation_bytes=256 * 1024))
    routes.fill()
    assert {r[0] for r in routes.routes} == {0, 1, 2, 3}
    load = Counter(h for r in routes.routes for h in r[1:])
    assert set(load) == {b.node_id for b in blocks} and max(load.values()) - min(load.values()) <= 1, load


def test_a_microbatch_goes_through_the_last_stage_replica_nearest_its_own_data_node():
    """Onward costs are per data node: an answer is about one microbatch, and the last hop is home."""
    west, east = PlanNode(0, 0, 0, 1.0, 4), PlanNode(1, 0, 2, 1.0, 4)
    middle = [PlanNode(2, 1, 1, 1.0, 4), PlanNode(3, 2, 1, 1.0, 4)]
    near_west, near_east = PlanNode(4, 3, 0, 1.0, 4), PlanNode(5, 3, 2, 1.0, 4)
    swarm = _swarm([west, east, *middle, near_west, near_east])
    table, rng = NeighbourTable(), random.Random(0)
    sender = middle[1]
    assert _greedy(rng, table, swarm, sender, 3) == 4  # bound for the west data node (home 0)
    table.decisions = 10 * ANNEAL_DECISIONS
    assert choose_next_hop(swarm, COST, sender, 3, table, rng, east.node_id) == 5
    assert onward_s(swarm, COST, near_west, table, 0) < onward_s(swarm, COST, near_west, table, 1)
