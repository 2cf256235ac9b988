"""DT-FM's schedule, the baseline: fixed full pipelines, each microbatch through every stage.

The pipelines are the chains of bottleneck matchings between consecutive stages (see
`allocation.py`); microbatches are dealt to them in turn, so at the paper's setting three pipelines
carry ten microbatches each and the two data nodes left over stay idle, as in the authors' runs.
"""

from __future__ import annotations

from shoal.planning.costs import CostModel
from shoal.planning.dtfm_objective import pipeline_chains
from shoal.planning.links import LinkTable
from shoal.planning.plan import IterationPlan, Route
from shoal.planning.swarm import Swarm


def plan_dtfm(swarm: Swarm, cost: CostModel, microbatches: int) -> IterationPlan:
    """Full-pipeline routes over the swarm's current stage allocation."""
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    index = {n.node_id: i for i, n in enumerate(nodes)}
    if any(not group for group in swarm.by_stage):
        raise ValueError("every stage needs at least one node for a full pipeline")
    parts = [[index[n.node_id] for n in group] for group in swarm.by_stage]
    _, chains = pipeline_chains(parts, LinkTable.build(swarm, cost, nodes))
    pipelines = [Route(nodes[c[0]].node_id, tuple(nodes[i].node_id for i in c[1:])) for c in chains]
    routes = tuple(pipelines[m % len(pipelines)] for m in range(microbatches))
    return IterationPlan("dtfm", swarm, routes)
