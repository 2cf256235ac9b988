"""What a simulated node knows: loads as last advertised at a heartbeat (what the replacement of a lost
hop weighs), and a view change that reaches the policy only at the next heartbeat plus the re-plan's
time, while the data nodes keep injecting."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.policy import GwtfPolicy
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.churn import ChurnConfig
from shoal.sim.engine import SimConfig, Simulator
from shoal.sim.run import RunSpec, build_swarm, simulate

COST = CostModel(activation_bytes=50, per_hop_overhead_s=0.05)
LAT = ((0.0, 0.1), (0.1, 0.0))
BW = ((1e12, 100.0), (100.0, 1e12))


class RecordingGwtf(GwtfPolicy):
    """GWTF that notes, in virtual time, the adverts the simulator would show a replacement, the view
    changes it is told of, and each microbatch's first hop."""

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        super().__init__(cost, rng)
        self.sim: Simulator | None = None
        self.loads: list[tuple[float, dict]] = []
        self.replans: list[tuple[float, tuple[int, ...]]] = []
        self.handed: list[tuple[float, int]] = []

    def next_hop(self, sender, stage, view, origin):
        self.loads.append((self.sim.now, dict(self.sim.known_load())))
        pick = super().next_hop(sender, stage, view, origin)
        if stage == 1:
            self.handed.append((self.sim.now, pick))
        return pick

    def view_changed(self, view: Swarm) -> None:
        self.replans.append((self.sim.now, tuple(sorted(view.by_id))))
        super().view_changed(view)


def _run(swarm: Swarm, cost: CostModel, config: SimConfig) -> tuple[Simulator, RecordingGwtf]:
    policy = RecordingGwtf(cost, random.Random(0))
    sim = Simulator(swarm, cost, policy, config, random.Random(0))
    policy.sim = sim
    sim.run()
    return sim, policy


def _leave_at_3(heartbeat_s: float, replan_s: float):
    # one data node with room for 4, two equal replicas of the only block stage; replica 1 leaves at 3.0
    nodes = (PlanNode(0, 0, 0, 1.0, 4), PlanNode(1, 1, 1, 2.0, 1), PlanNode(2, 1, 1, 2.0, 1))
    config = SimConfig(microbatches=8, heartbeat_s=heartbeat_s, replan_s=replan_s, scripted=((3.0, "leave", 1),))
    return _run(Swarm(nodes, 2, LAT, BW), COST, config)


def test_a_view_change_reaches_the_plan_at_the_next_heartbeat_plus_the_replan_time():
    sim, policy = _leave_at_3(heartbeat_s=10.0, replan_s=1.0)
    assert policy.replans == [(11.0, (0, 2))]  # seen at the tick at 10 s, in force 1 s later
    assert sim.stats["completed"] == 8
    # meanwhile the data node kept injecting, and sent nothing to the node that had left
    assert any(t > 3.0 for t, _ in policy.handed)
    assert all(pick == 2 for t, pick in policy.handed if t > 3.0)
    assert _leave_at_3(heartbeat_s=0.0, replan_s=0.0)[1].replans == [(3.0, (0, 2))]  # omniscient: at once
    assert _leave_at_3(heartbeat_s=0.0, replan_s=2.0)[1].replans == [(5.0, (0, 2))]


def _random_gwtf(heartbeat_s: float, churn: float = 0.0):
    scenario, swarm = build_swarm(RunSpec(scenario="random", nodes=24, stages=5, seed=1))
    config = SimConfig(microbatches=80, heartbeat_s=heartbeat_s, churn=ChurnConfig(rate_per_node_hour=churn))
    return _run(swarm, scenario.cost_model(), config)


def test_the_load_a_node_knows_of_is_the_one_advertised_at_the_last_heartbeat():
    _, policy = _random_gwtf(heartbeat_s=10.0)
    seen: dict[int, list[dict]] = defaultdict(list)
    for now, load in policy.loads:
        seen[int(now // 10.0)].append(load)
    assert seen[0] and all(not any(load.values()) for load in seen[0]), "before the first heartbeat: none"
    assert any(any(load.values()) for loads in seen.values() for load in loads)
    for loads in seen.values():
        assert all(load == loads[0] for load in loads), "one snapshot per heartbeat interval"
    _, exact = _random_gwtf(heartbeat_s=0.0)
    windows: dict[int, list[dict]] = defaultdict(list)
    for now, load in exact.loads:
        windows[int(now // 10.0)].append(load)
    assert any(any(load != loads[0] for load in loads) for loads in windows.values()), "exact loads move"


@pytest.mark.parametrize("policy", ["swarm", "gwtf", "random"])
def test_a_seed_gives_the_same_run_under_churn(policy):
    spec = RunSpec(scenario="random", policy=policy, nodes=24, stages=5, microbatches=40, churn=30.0, seed=4)
    first, second = simulate(spec).to_dict(), simulate(spec).to_dict()
    for result in (first, second):
        result.pop("scheduler_wall_s")
        result.pop("scheduler_wall_by_call")
    assert first == second
