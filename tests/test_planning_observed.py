"""Routing's throughput from observed trips: a replica slower than it claims is capped, the others
keep their claims, and a peer seen too little keeps its own."""

from __future__ import annotations

import random

import pytest

from shoal.planning.observed import MIN_TRIPS, Trip, capped_throughput, claimed_hop_s, hop_times, observed_view
from shoal.planning.swarm_view import NodeInfo, SwarmView

BACKWARD_FACTOR = 2.0
TRUE_HOP_S = {"a1": 0.05, "a2": 0.5, "b1": 0.05, "b2": 0.08}  # a2 claims as much as a1 but is ten times slower
SHARED_S = 0.02  # embedding, loss, transfers: on every trip


def view() -> SwarmView:
    claim = 1 / 0.05 / (1 + BACKWARD_FACTOR)  # one block: a claimed hop of 0.05 s
    nodes = [NodeInfo("data", "data", 0, "active", 0.0, 4)]
    nodes += [NodeInfo(p, "worker", 1 if p[0] == "a" else 2, "active", claim, 4) for p in TRUE_HOP_S]
    return SwarmView("run", 3, (0, 1, 1), tuple(nodes))


def trips(n: int, seed: int = 0, noise: float = 0.005) -> list[Trip]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        route = (rng.choice(["a1", "a2"]), rng.choice(["b1", "b2"]))
        seconds = SHARED_S + sum(TRUE_HOP_S[p] for p in route) + rng.uniform(-noise, noise)
        out.append(Trip(route, seconds))
    return out


def test_a_replica_slower_than_its_claim_is_found_and_capped():
    v = view()
    prior = {n.peer_id: claimed_hop_s(n, 1, BACKWARD_FACTOR) for n in v.live_nodes() if n.stage > 0}
    fitted = hop_times(trips(60), prior, {n.peer_id: n.stage for n in v.nodes})
    assert fitted["a1"] == pytest.approx(0.05) and fitted["b1"] == pytest.approx(0.05)  # the stages' best: as claimed
    assert fitted["a2"] == pytest.approx(0.5, abs=0.03) and fitted["b2"] == pytest.approx(
        0.08, abs=0.01
    )  # ridge: a little shrunk
    routed = {n.peer_id: n.block_throughput for n in observed_view(v, trips(60), BACKWARD_FACTOR).nodes}
    claim = v.nodes[1].block_throughput
    assert routed["a2"] < claim / 5  # about a tenth of its claim
    assert routed["a1"] == claim and routed["b1"] == claim  # as fast as claimed: unchanged, never raised
    assert routed["b2"] < claim and routed["b2"] > claim / 3  # somewhat slower than claimed (0.08 s for 0.05 s)


def test_peers_seen_on_too_few_trips_keep_their_claims():
    v = view()
    few = trips(MIN_TRIPS - 1)
    assert observed_view(v, few, BACKWARD_FACTOR) == v
    assert observed_view(v, [], BACKWARD_FACTOR) == v


def test_a_claim_is_only_ever_lowered():
    assert capped_throughput(10.0, 0.05, None) == 10.0
    assert capped_throughput(10.0, 0.05, 0.01) == 10.0  # faster than it says: not promoted beyond its claim
    assert capped_throughput(10.0, 0.05, 0.5) == pytest.approx(1.0)
