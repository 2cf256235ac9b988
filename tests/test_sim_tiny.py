"""Tiny swarms whose makespans are worked out by hand, with and without a crash.

Times: the data node's forward takes 1 s, a block node's 2 s; backward is 1.5x, loss and head
0.25x; every hop costs 0.05 s overhead + 0.1 s latency + 50 B / 100 B/s = 0.65 s.
One microbatch: 1 + .65 + 2 + .65 + .25 + .65 + 3 + .65 + 1.5 = 10.35 s.
"""

from __future__ import annotations

import random

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.policy import make_policy
from shoal.planning.skippipe import SkipPipeOptions
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.engine import SimConfig, Simulator

COST = CostModel(activation_bytes=50, per_hop_overhead_s=0.05)
LAT = ((0.0, 0.1), (0.1, 0.0))
BW = ((1e12, 100.0), (100.0, 1e12))


def _run(nodes, policy: str, microbatches: int, scripted=(), skip=0.0):
    swarm = Swarm(tuple(nodes), 2, LAT, BW)
    options = SkipPipeOptions(skip=skip)
    chosen = make_policy(policy, COST, random.Random(0), options, allocate=False)
    config = SimConfig(microbatches=microbatches, failure_timeout_s=5.0, scripted=tuple(scripted))
    return Simulator(swarm, COST, chosen, config, random.Random(0)).run()


def _pair(data_memory: int, block_memory: int):
    return [PlanNode(0, 0, 0, 1.0, data_memory), PlanNode(1, 1, 1, 2.0, block_memory)]


def test_one_microbatch_takes_the_hand_computed_time():
    result = _run(_pair(1, 1), "dtfm", 1)
    assert result.makespan_s == pytest.approx(10.35)
    assert result.busy_s == pytest.approx(1 + 2 + 0.25 + 3 + 1.5)
    assert result.collision_s == 0 and result.memory_wait_s == 0


def test_a_data_node_with_memory_for_one_runs_its_microbatches_back_to_back():
    assert _run(_pair(1, 1), "dtfm", 2).makespan_s == pytest.approx(20.7)


def test_a_full_block_node_makes_the_second_activation_wait():
    # mb1's forward queues behind mb0's on the data node (1 s of collision); it reaches the block
    # node at 2.65 and waits for mb0's backward to free its only slot at 8.2 (5.55 s of memory wait)
    result = _run(_pair(2, 1), "dtfm", 2)
    assert result.makespan_s == pytest.approx(16.9)
    assert result.collision_s == pytest.approx(1.0)
    assert result.memory_wait_s == pytest.approx(5.55)


def test_skippipe_predicts_the_same_makespan_and_the_simulator_realises_its_plan():
    result = _run(_pair(2, 1), "skippipe", 2)
    assert result.predicted_makespan_s == pytest.approx(16.9)
    assert result.makespan_s == pytest.approx(16.9)
    assert result.collision_s == pytest.approx(0.0)  # the plan's waits are planned, not collisions
    assert result.planned_wait_s == pytest.approx(5.55)  # mb1 is released at 1.0, then held for memory


def _replicated():
    return [PlanNode(0, 0, 0, 1.0, 1), PlanNode(1, 1, 1, 2.0, 1), PlanNode(2, 1, 1, 2.0, 1)]


def test_gwtf_redoes_only_the_hop_lost_mid_backward():
    # node 1 dies at 6.0, 0.8 s into its backward (5.2 to 8.2). The data node times out at 11.0 and
    # re-sends its kept activation to node 2 (11.65), which recomputes forward (to 13.65) and runs
    # backward with the re-sent gradient (to 16.65); the data node's backward ends at 18.8.
    result = _run(_replicated(), "gwtf", 1, scripted=[(6.0, "crash", 1)])
    assert result.completed == 1 and result.abandoned == 0
    assert result.makespan_s == pytest.approx(18.8)
    assert result.recomputed_hops == 1 and result.restarted == 0
    assert result.wasted_compute_s == pytest.approx(2.0 + 0.8)  # the lost forward and partial backward
    assert result.churn["crash_mid_backward"] == 1


def test_swarm_also_redoes_only_the_hop_lost_mid_backward():
    # SWARM's public client keeps a stage's inputs and retries a failed backward call on another replica,
    # which recomputes forward and runs backward: the same timeline and waste as GWTF's rule above. SWARM
    # draws between the two idle replicas at random, so crash each in turn; the one it did not choose
    # crashes idle and costs nothing.
    results = [_run(_replicated(), "swarm", 1, scripted=[(6.0, "crash", victim)]) for victim in (1, 2)]
    hit = [r for r in results if r.churn.get("crash_mid_backward")]
    missed = [r for r in results if r.churn.get("crash_idle")]
    assert len(hit) == 1 and len(missed) == 1
    assert hit[0].completed == 1 and hit[0].makespan_s == pytest.approx(18.8)
    assert hit[0].recomputed_hops == 1 and hit[0].restarted == 0
    assert hit[0].wasted_compute_s == pytest.approx(2.0 + 0.8)  # the lost forward and partial backward
    assert missed[0].makespan_s == pytest.approx(10.35) and missed[0].wasted_compute_s == 0


def test_a_crashed_data_node_abandons_its_microbatches_with_a_reason():
    nodes = [PlanNode(0, 0, 0, 1.0, 2), PlanNode(3, 0, 0, 1.0, 2), PlanNode(1, 1, 1, 2.0, 3)]
    result = _run(nodes, "skippipe", 4, scripted=[(2.0, "crash", 0)])
    assert result.abandoned_reasons == {"data node crashed": 2}
    assert result.completed + result.abandoned == result.injected == 4
