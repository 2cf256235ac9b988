"""Replay a plan made elsewhere (another scheduler's paths, another baseline's wiring) in the simulator.

The benchmark uses this to score the SkipPipe authors' own paths and DT-FM pipelines on the same
partition and cost model as shoal's planners, so the comparison differs only in the schedule; and
benchmarks/skippipe_timetable.py to replay what data nodes planned over, as they wrote it down.
"""

from __future__ import annotations

import random
from dataclasses import replace

from shoal.planning.costs import CostModel
from shoal.planning.plan import IterationPlan, Timing
from shoal.planning.policy import Policy
from shoal.planning.swarm import PlanNode, Swarm
from shoal.sim.engine import SimConfig, Simulator
from shoal.sim.metrics import SimResult


class FixedPlanPolicy(Policy):
    """A static policy whose plan is given: the swarm and routes (and timings, if any) are used as is."""

    def __init__(self, plan: IterationPlan, cost: CostModel) -> None:
        super().__init__(cost, random.Random(0))
        self.name = plan.policy
        self.fixed = plan

    def start(self, view: Swarm, microbatches: int) -> Swarm:
        self.plan = self.fixed
        return self.fixed.swarm


def simulate_plan(plan: IterationPlan, cost: CostModel, seed: int = 0) -> SimResult:
    """One iteration of `plan` over its own swarm, no churn: nodes follow its routes (and its timetable)."""
    config = SimConfig(microbatches=len(plan.routes))
    sim = Simulator(plan.swarm, cost, FixedPlanPolicy(plan, cost), config, random.Random(f"sim:{seed}"))
    return sim.run()


def releases_only(plan: IterationPlan) -> IterationPlan:
    """`plan` with only its release times kept: each microbatch leaves its data node when planned,
    and every hop after that starts as soon as its node is free (what a node that follows the
    timetable's releases but not its hop times does)."""
    if plan.timings is None:
        return plan
    timings = tuple(
        Timing(t.release_s, (0.0,) * len(t.forward_s), 0.0, (0.0,) * len(t.backward_s), 0.0, t.end_s)
        for t in plan.timings
    )
    return replace(plan, timings=timings)


def swarm_from_dict(data: dict) -> Swarm:
    """The `Swarm` that `dataclasses.asdict` wrote (a data node's `planned_over` progress event)."""
    return Swarm(
        tuple(PlanNode(**node) for node in data["nodes"]),
        data["stages"],
        tuple(tuple(row) for row in data["latency_s"]),
        tuple(tuple(row) for row in data["bandwidth_Bps"]),
        tuple(data.get("site_names", ())),
    )
