"""Replay a plan made elsewhere (another scheduler's paths, another baseline's wiring) in the simulator.

The benchmark uses this to score the SkipPipe authors' own paths and DT-FM pipelines on the same
partition and cost model as shoal's planners, so the comparison differs only in the schedule.
"""

from __future__ import annotations

import random

from shoal.planning.costs import CostModel
from shoal.planning.plan import IterationPlan
from shoal.planning.policy import Policy
from shoal.planning.swarm import Swarm
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
