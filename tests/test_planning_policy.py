"""The routing policies' registry (planning/policy.py): every name the simulator and the node accept
builds its policy, and a joiner is placed by one function wherever it joins."""

from __future__ import annotations

import argparse
import random

import pytest

from shoal.config import ConfigError
from shoal.node.config import ROUTINGS, PlacementOptions
from shoal.planning.costs import CostModel
from shoal.planning.peer_router import PeerRouter
from shoal.planning.policy import POLICIES, ROUTING_POLICIES, join_stage, make_policy
from shoal.planning.skippipe import SkipPipeOptions
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.command import add_arguments

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)
SITES = 2
LAT = tuple(tuple(0.001 if a == b else 0.05 for b in range(SITES)) for a in range(SITES))
BW = tuple(tuple(2e9 if a == b else 1e8 for b in range(SITES)) for a in range(SITES))


def _swarm(stages: tuple[int, ...]) -> Swarm:
    """A data node and one node per entry of `stages`, alternating sites."""
    nodes = [PlanNode(0, 0, 0, 1.0, 4)] + [PlanNode(i, s, i % SITES, 0.5 + 0.1 * i, 4) for i, s in enumerate(stages, 1)]
    return Swarm(tuple(nodes), 4, LAT, BW)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_is_built_by_its_name(name):
    policy = make_policy(name, COST, random.Random(0))
    assert type(policy) is POLICIES[name]
    assert policy.name == name
    nocollision = make_policy(name, COST, random.Random(0), SkipPipeOptions(collision_aware=False))
    assert nocollision.name == ("skippipe-nocollision" if name == "skippipe" else name)


def test_an_unknown_policy_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="choose from dtfm, random-skip, skippipe"):
        make_policy("nope", COST, random.Random(0))


def test_the_simulator_offers_every_registered_policy():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "policy")
    assert list(action.choices) == list(POLICIES)


def test_every_routing_the_node_accepts_resolves_and_every_live_policy_is_accepted():
    assert ROUTINGS == ("auto", *ROUTING_POLICIES)
    for name in ROUTING_POLICIES:
        assert PlacementOptions(routing=name).routing == name
        assert PeerRouter(name, COST).name == name
    static = [name for name, policy in POLICIES.items() if not policy.routes_live]
    assert static == ["dtfm", "random-skip", "skippipe"]  # they plan a whole iteration up front
    for name in static:
        with pytest.raises(ConfigError):
            PlacementOptions(routing=name)
        with pytest.raises(ValueError, match="unknown routing"):
            PeerRouter(name, COST)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_joiner_fills_a_stage_left_empty_first_as_every_policy_would(name):
    policy = make_policy(name, COST, random.Random(0))
    newcomer = PlanNode(99, 1, 1, 0.7, 4)
    one_empty = _swarm((1, 1, 3))
    assert join_stage(policy, one_empty, newcomer) == policy.place(one_empty, newcomer) == 2
    two_empty = _swarm((2,))
    assert join_stage(policy, two_empty, newcomer) == policy.place(two_empty, newcomer) == 1
    full = _swarm((1, 2, 3, 3))
    assert join_stage(policy, full, newcomer) == policy.place(full, newcomer)
