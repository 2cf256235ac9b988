"""Random skipping, the oblivious baseline: legal partial paths drawn without looking at the network.

Each path follows the same rules as SkipPipe's (equal visits per stage, no revisits, stage 0 at
both ends) and each node gets an equal share of its stage's visits; which stages and which nodes is
left to the seeded random draw, so the comparison with SkipPipe isolates network-aware scheduling.
"""

from __future__ import annotations

import random

from shoal.planning.paths import block_visits, stage_moves, visit_quotas
from shoal.planning.plan import IterationPlan, Route
from shoal.planning.skippipe import microbatches_per_origin
from shoal.planning.swarm import Swarm


def plan_random_skip(swarm: Swarm, microbatches: int, skip: float, rng: random.Random) -> IterationPlan:
    """Random legal partial paths, microbatches dealt evenly over the data nodes."""
    visits = block_visits(swarm.stages, skip)
    quota = visit_quotas(microbatches, swarm.stages, visits)
    load = {n.node_id: 0 for n in swarm.nodes}
    per_origin = microbatches_per_origin(swarm, microbatches)
    origins = [d for d in sorted(per_origin) for _ in range(per_origin[d])]
    rng.shuffle(origins)
    remaining = microbatches
    routes = []
    for origin in origins:
        frontier, hops = 0, []
        for hop in range(visits):
            moves = stage_moves(frontier, None, 0, visits - hop, quota, remaining, None, 0)
            stage, frontier, _, _ = rng.choice(moves)
            group = swarm.by_stage[stage]
            least = min(load[n.node_id] for n in group)
            node = rng.choice([n for n in group if load[n.node_id] == least])
            load[node.node_id] += 1
            hops.append(node.node_id)
        for h in hops:
            quota[swarm.node(h).stage] -= 1
        remaining -= 1
        routes.append(Route(origin, tuple(hops)))
    return IterationPlan("random-skip", swarm, tuple(routes))
