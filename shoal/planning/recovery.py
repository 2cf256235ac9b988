"""Churn decisions: who redoes a lost hop, and which stage a joining node should take.

Both follow GWTF: a lost hop goes to the live replica of the same stage that is cheapest between
the hop's neighbours by GWTF's hop cost (only that hop is redone, from the activation the upstream
neighbour kept), and a joining node takes the stage where greedy routes gain the most estimated
throughput (`flow_estimate.py`). Static schedules (DT-FM, SkipPipe) use the same replacement rule when a
planned node dies mid-iteration.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from shoal.planning.costs import CostModel
from shoal.planning.flow_estimate import greedy_throughput
from shoal.planning.gwtf import hop_cost
from shoal.planning.swarm import NodeId, PlanNode, StageIndex, Swarm


def replacement_node(
    view: Swarm,
    cost: CostModel,
    stage: StageIndex,
    prev: PlanNode,
    nxt: PlanNode,
    exclude: Collection[NodeId] = (),
    load: Mapping[NodeId, int] | None = None,
) -> PlanNode | None:
    """The live replica of `stage` to redo a hop between `prev` and `nxt`, or None if none is left.

    Nodes with spare memory (by `load`, the microbatches each is known to hold) come first; among
    them the lowest d(prev, j) + d(j, nxt), plus one compute time per microbatch already held.
    """
    load = load or {}
    best: tuple[tuple[bool, float, NodeId], PlanNode] | None = None
    for node in view.by_stage[stage]:
        if node.node_id in exclude:
            continue
        held = load.get(node.node_id, 0)
        score = hop_cost(view, cost, prev, node) + hop_cost(view, cost, node, nxt) + held * cost.compute_s(node)
        key = (held >= node.memory, score, node.node_id)
        if best is None or key < best[0]:
            best = (key, node)
    return None if best is None else best[1]


def place_joining_node(view: Swarm, cost: CostModel, newcomer: PlanNode) -> StageIndex:
    """The block stage where `newcomer` raises the greedy routes' estimated throughput the most.

    The newcomer's `forward_s` is taken as its time for any one block stage (block stages hold the
    same number of layers). Where the estimate cannot tell stages apart (the routes are limited
    elsewhere, e.g. by the data nodes), the stage with the least compute gets the node, then the
    lowest: a stage a crash left short is refilled first.
    """
    if view.stages < 2:
        raise ValueError("a swarm without block stages has nowhere to place a node")
    gains = {}
    for stage in range(1, view.stages):
        trial = view.with_nodes(view.nodes + (replace(newcomer, stage=stage),))
        gains[stage] = greedy_throughput(trial, cost)
    top = max(gains.values())
    tied = [stage for stage, gain in gains.items() if gain >= top * (1 - 1e-9)]

    def compute_rate(stage: StageIndex) -> float:
        return sum(1.0 / cost.compute_s(n) for n in view.by_stage[stage])

    return min(tied, key=lambda stage: (compute_rate(stage), stage))
