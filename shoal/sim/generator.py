"""Random heterogeneous swarms of any size over a scenario's regions (the network stays measured data;
`shoal sim --scenario random` uses gcp12's with its NL-London typo corrected to 0.2368 GiB/s).

Stated constants: a node sits in a uniformly drawn region; with heterogeneous compute its speed is
log-uniform in [0.5, 2] x the scenario's (so a stage's forward takes 0.5x to 2x as long), its memory
uniform in 2..6 microbatches and its own access bandwidth log-uniform in [0.05, 1] GiB/s; with
homogeneous compute every node has the scenario's speed and memory and no access cap. Stage sizes
follow `stage_sizes` (a quarter of the nodes hold data), and which node gets which stage is drawn.
"""

from __future__ import annotations

import math
import random

from shoal.planning.swarm import NodeId, PlanNode, Swarm
from shoal.sim.scenario import GIB, Scenario, stage_sizes

SPEED_RANGE = (0.5, 2.0)
MEMORY_RANGE = (2, 6)
ACCESS_GIBPS_RANGE = (0.05, 1.0)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def random_node(
    scenario: Scenario, stages: int, node_id: NodeId, stage: int, rng: random.Random, heterogeneous: bool
) -> PlanNode:
    """One node drawn from the generator's distributions (also how joining nodes are made)."""
    site = rng.randrange(len(scenario.regions))
    forward = scenario.stage_forward_s(stages)
    if not heterogeneous:
        return PlanNode(node_id, stage, site, forward, scenario.memory)
    speed = _log_uniform(rng, *SPEED_RANGE)
    memory = rng.randint(*MEMORY_RANGE)
    access = _log_uniform(rng, *ACCESS_GIBPS_RANGE) * GIB
    return PlanNode(node_id, stage, site, forward / speed, memory, access)


def random_swarm(scenario: Scenario, nodes: int, stages: int, rng: random.Random, heterogeneous: bool = True) -> Swarm:
    sizes = stage_sizes(scenario, nodes, stages)
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    rng.shuffle(stage_of)
    members = tuple(random_node(scenario, stages, i, stage_of[i], rng, heterogeneous) for i in range(nodes))
    return Swarm(members, stages, scenario.latency_s, scenario.bandwidth_Bps, scenario.regions)
