"""The daemon's routing seam: policies over a SwarmView and measured links, answered in peer ids."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shoal.planning.assignment import Candidate
from shoal.planning.costs import CostModel
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.policy import RandomPolicy, make_policy
from shoal.planning.swarm_view import NodeInfo, SwarmView

COST = CostModel(activation_bytes=256 * 1024)


def _node(peer: str, stage: int, throughput: float = 10.0, inflight: int = 4, started: float = 0.0) -> NodeInfo:
    return NodeInfo(peer, "data" if stage == 0 else "worker", stage, "active", throughput, inflight,
                    started_at=started)  # fmt: skip


def _view(*nodes: NodeInfo) -> SwarmView:
    return SwarmView("run", 3, (0, 2, 2), tuple(nodes))


SWARM = _view(_node("data", 0), _node("a1", 1), _node("a2", 1), _node("b1", 2), _node("b2", 2))


def _router(policy: str, view: SwarmView = SWARM, links=None) -> PeerRouter:
    router = PeerRouter(policy, COST, seed=1)
    router.update(Snapshot(view, "data", links or {}))
    return router


def test_gwtf_routes_around_a_slow_link_it_measured():
    far = {("data", "a2"): (0.5, 1e6), ("a2", "b1"): (0.5, 1e6), ("a2", "b2"): (0.5, 1e6)}
    near = {(a, b): (0.001, 1e9) for a, b in [("data", "a1"), ("a1", "b1"), ("a1", "b2"), ("b1", "data"),
                                              ("b2", "data")]}  # fmt: skip
    router = _router("gwtf", links={**far, **near})
    first = router.route("data")
    assert first is not None and first.hops[0] == (1, "a1")
    assert [stage for stage, _ in first.hops] == [1, 2]


def test_capacity_routing_spreads_microbatches_over_replicas_and_gives_slots_back():
    router = _router("capacity")
    routes = [router.route("data") for _ in range(4)]
    assert Counter(r.hops[0][1] for r in routes) == {"a1": 2, "a2": 2}
    for r in routes:
        router.end(r)
    assert sum(router.policy.in_use.values()) == 0


def test_an_excluded_peer_is_replaced_and_none_when_a_stage_has_nobody_else():
    for policy in ("gwtf", "swarm", "capacity"):
        router = _router(policy)
        routed = router.route("data", exclude={"a1", "b2"})
        assert routed is not None and [p for _, p in routed.hops] == ["a2", "b1"], policy
        assert router.route("data", exclude={"a1", "a2"}) is None, policy
        assert router.replace(1, "data", "b1", exclude={"a1"}) == "a2", policy
        assert router.replace(1, "data", "b1", exclude={"a1", "a2"}) is None, policy


def test_swarm_routing_is_hop_by_hop_and_learns_from_observed_times():
    router = _router("swarm")
    assert router.hop_by_hop
    router.next_hop("a1", 2, "data")  # a sender's balancer exists once it has sent
    for _ in range(20):
        router.observe("a1", "b1", 2, 5.0)
        router.observe("a1", "b2", 2, 0.05)
    picks = Counter(router.next_hop("a1", 2, "data") for _ in range(20))
    assert picks["b2"] > picks["b1"]


def test_node_ids_stay_stable_when_peers_come_and_go():
    router = _router("gwtf")
    before = dict(router.ids)
    router.update(Snapshot(_view(_node("data", 0), _node("a2", 1), _node("b1", 2), _node("c9", 1)), "data"))
    assert all(router.ids[p] == i for p, i in before.items())
    assert router.ids["c9"] not in before.values()
    routed = router.route("data")
    assert routed is not None and "a1" not in {p for _, p in routed.hops}


def test_a_stage_without_replicas_gives_no_route():
    router = _router("gwtf", _view(_node("data", 0), _node("a1", 1)))
    assert router.route("data") is None


@pytest.mark.parametrize("policy", ["gwtf", "swarm"])
def test_a_joiner_goes_where_the_swarm_is_weakest(policy):
    view = _view(_node("data", 0), _node("a1", 1, 10.0), _node("a2", 1, 10.0), _node("b1", 2, 2.0),
                 _node("new", 1, 10.0, started=5.0))  # fmt: skip
    router = _router(policy, view)
    me = Candidate("new", 10.0, started_at=5.0)
    assert router.place(view, me, forward_s=0.05, memory=4) == 2


def test_empty_stages_and_the_data_role_follow_the_assignment_rules():
    view = _view(_node("a1", 1), _node("new", 1, started=5.0))
    router = _router("gwtf", view)
    assert router.place(view, Candidate("new", 10.0, started_at=5.0), forward_s=0.05, memory=4) == 0


def test_skippipe_paths_visit_a_share_of_the_block_stages_and_each_equally():
    from shoal.planning.skippipe import SkipPipeOptions

    view = SwarmView("run", 5, (0, 1, 1, 1, 1), (_node("data", 0), *[_node(f"w{s}", s) for s in range(1, 5)]))
    router = _router("gwtf", view)
    paths = router.plan_paths("data", 8, SkipPipeOptions(skip=0.25))
    assert paths is not None and len(paths) == 8
    for path in paths:
        stages = [stage for stage, _ in path.hops]
        assert len(stages) == 3 and stages == sorted(stages)  # 3 of 4 block stages, in order
        assert all(peer == f"w{stage}" for stage, peer in path.hops)
    visits = Counter(stage for path in paths for stage, _ in path.hops)
    assert max(visits.values()) - min(visits.values()) <= 1  # every stage sees the same share of the data
    assert _router("gwtf", _view(_node("data", 0), _node("a1", 1))).plan_paths("data", 4, SkipPipeOptions()) is None


def test_the_daemons_default_noloco_routing_is_the_policy_the_simulator_runs():
    """One algorithm, one place: `--routing random` (the daemon under NoLoCo) and `shoal sim --policy
    random` build the same `RandomPolicy`, which spreads microbatches over replicas by speed."""
    router = _router("random")
    assert type(router.policy) is type(make_policy("random", COST, random.Random(0))) is RandomPolicy
    picks = Counter(router.route("data").hops for _ in range(400))
    assert len(picks) == 4 and min(picks.values()) > 60, picks


def test_fixed_lanes_never_mix_replicas_and_use_every_lane_in_turn():
    """NoLoCo's ablation baseline: replica i of stage 1 only ever feeds replica i of stage 2."""
    router = _router("fixed")
    routes = [router.route("data").hops for _ in range(6)]
    assert routes == [((1, "a1"), (2, "b1")), ((1, "a2"), (2, "b2"))] * 3
    uneven = _router("fixed", _view(_node("data", 0), _node("a1", 1), _node("a2", 1), _node("b1", 2)))
    assert {uneven.route("data").hops for _ in range(4)} == {((1, "a1"), (2, "b1"))}


@pytest.mark.parametrize(
    ("role", "stage", "misfit"),
    [
        ("data", 0, None),
        ("rollout", 0, None),
        ("worker", 1, None),
        ("worker", 2, None),
        ("worker", 3, "a worker of stage 3, outside 1..2"),  # at the run's stage count
        ("worker", 4096, "a worker of stage 4096, outside 1..2"),
        ("worker", 0, "a worker of stage 0, outside 1..2"),
        ("data", 2, "a data node of stage 2, not of stage 0"),
        ("rollout", 1, "a rollout node of stage 1, not of stage 0"),
    ],
)
def test_a_node_stands_in_a_view_only_on_a_stage_its_role_and_the_run_allow(role, stage, misfit):
    """The view reader (dht/swarm.py `read_view`) leaves out every record `stage_misfit` names: one at or
    past the run's stage count made `swarm_from_view` raise IndexError on every view of the run, and a
    data node's record at a block stage made it a replica routes could send through."""
    from shoal.planning.swarm_view import stage_misfit

    assert stage_misfit(NodeInfo("x", role, stage, "active", 10.0, 4), stages=3) == misfit
