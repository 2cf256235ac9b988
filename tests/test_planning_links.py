"""The vectorised transfer table agrees with CostModel.transfer_s to the last bit, with and without
its precomputed full table."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shoal.planning import links as links_module
from shoal.planning.costs import CostModel
from shoal.planning.links import LinkTable
from shoal.planning.swarm import PlanNode, Swarm

COST = CostModel(activation_bytes=32 * 2**20, per_hop_overhead_s=0.35)


def _swarm(seed: int, nodes: int = 60, sites: int = 6, capped: bool = True) -> Swarm:
    """Asymmetric links, some sites empty, access caps on some nodes (ties included)."""
    rng = random.Random(seed)
    caps = [float("inf"), 5e7, 5e7, 2e8]
    members = tuple(
        PlanNode(
            i,
            rng.randrange(4),
            rng.randrange(sites - 1),  # the last site holds nobody
            1.0,
            3,
            rng.choice(caps) if capped else float("inf"),
        )
        for i in range(nodes)
    )
    lat = tuple(tuple(0.001 if a == b else rng.uniform(0.005, 0.2) for b in range(sites)) for a in range(sites))
    bw = tuple(tuple(2e9 if a == b else rng.uniform(1e7, 3e8) for b in range(sites)) for a in range(sites))
    return Swarm(members, 4, lat, bw)


@pytest.fixture(params=[True, False], ids=["full-table", "on-demand"])
def full_table(request, monkeypatch) -> bool:
    if not request.param:
        monkeypatch.setattr(links_module, "FULL_TABLE_UP_TO", 0)
    return request.param


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capped", [True, False])
def test_blocks_equal_transfer_s_exactly(seed, capped, full_table):
    swarm = _swarm(seed, capped=capped)
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    table = LinkTable.build(swarm, COST, nodes)
    assert (table.full is not None) == full_table
    reference = np.array([[COST.transfer_s(swarm, a, b) for b in nodes] for a in nodes])
    everyone = np.arange(len(nodes))
    assert (table.block(everyone, everyone) == reference).all()
    rows, cols = [5, 0, 17, 5], [3, 3, 40, 11, 5]
    assert (table.block(rows, cols) == reference[np.ix_(rows, cols)]).all()
    assert (table.pairwise(rows, cols[:4]) == reference[rows, cols[:4]]).all()
    assert np.allclose(table.mean_transfer_s(), reference.mean(axis=1), rtol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_slowest_pair_is_the_max_of_the_block(seed, full_table):
    swarm = _swarm(seed)
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    table = LinkTable.build(swarm, COST, nodes)
    everyone = np.arange(len(nodes))
    reference = table.block(everyone, everyone)
    rng = np.random.default_rng(seed)
    for size in (0, 1, 2, 3, 7, 30, 60):
        members = rng.choice(len(nodes), size=size, replace=False)
        expected = reference[np.ix_(members, members)].max() if size >= 2 else 0.0
        value, a, b = table.slowest_pair(members)
        assert value == expected == table.slowest_within(members)
        if size >= 2:
            assert a != b and {a, b} <= set(members.tolist()) and reference[a, b] == value
