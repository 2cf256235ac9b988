"""The shared time model and GWTF's hop cost, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.gwtf import hop_cost, path_cost
from shoal.planning.plan import Route
from shoal.planning.swarm import PlanNode, Swarm

# two sites with asymmetric links: 10 ms one way, 30 ms back; 100 MB/s one way, 300 MB/s back
LAT = ((0.001, 0.010), (0.030, 0.001))
BW = ((1e9, 1e8), (3e8, 1e9))


def _swarm(*nodes: PlanNode, stages: int = 2) -> Swarm:
    return Swarm(tuple(nodes), stages, LAT, BW)


def test_transfer_time_is_overhead_plus_latency_plus_size_over_the_narrowest_bandwidth():
    cost = CostModel(activation_bytes=1e8, per_hop_overhead_s=0.35)
    a, b = PlanNode(0, 0, 0, 1.0, 3), PlanNode(1, 1, 1, 2.0, 3, bandwidth_Bps=5e7)
    swarm = _swarm(a, b)
    assert cost.transfer_s(swarm, a, b) == pytest.approx(0.35 + 0.010 + 1e8 / 5e7)  # b's own cap binds
    assert cost.transfer_s(swarm, b, a) == pytest.approx(0.35 + 0.030 + 1e8 / 5e7)
    assert cost.transfer_s(swarm, a, a) == 0.0
    assert cost.backward_s(b) == pytest.approx(3.0)
    assert cost.compute_s(a) == pytest.approx(1.0 + 1.5 + 0.25)  # a data node also runs loss and head
    assert cost.compute_s(b) == pytest.approx(2.0 + 3.0)


def test_gwtf_hop_cost_averages_both_directions():
    cost = CostModel(activation_bytes=2e8)
    i, j = PlanNode(0, 0, 0, 1.0, 3), PlanNode(1, 1, 1, 2.0, 3)
    swarm = _swarm(i, j)
    c_i, c_j = 2.75, 5.0  # forward + backward (+ head on the data node)
    expected = (c_i + c_j) / 2 + (0.010 + 0.030) / 2 + 2 * 2e8 / (1e8 + 3e8)
    assert expected == pytest.approx(3.875 + 0.020 + 1.0)
    assert hop_cost(swarm, cost, i, j) == pytest.approx(expected)
    assert hop_cost(swarm, cost, j, i) == pytest.approx(expected)  # symmetric by construction


def test_path_cost_sums_the_hops_out_of_and_back_into_the_data_node():
    cost = CostModel(activation_bytes=2e8)
    d, x, y = PlanNode(0, 0, 0, 1.0, 3), PlanNode(1, 1, 1, 2.0, 3), PlanNode(2, 2, 0, 1.0, 3)
    swarm = _swarm(d, x, y, stages=3)
    route = Route(0, (1, 2))
    expected = hop_cost(swarm, cost, d, x) + hop_cost(swarm, cost, x, y) + hop_cost(swarm, cost, y, d)
    assert path_cost(swarm, cost, route) == pytest.approx(expected)
