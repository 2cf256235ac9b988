"""What a planner knows about a swarm: its nodes and the links between the sites they sit at.

Links are kept per *site* (a region in the simulator, a single peer in the daemon's view), so a
view of 5,000 nodes spread over a dozen regions costs a 12 x 12 table rather than 25 million
pairs. A node may also cap its own access bandwidth, which is how heterogeneous uplinks are told
apart inside one site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

NodeId = int  # stable within one run; the daemon maps peer ids to small integers in its view
StageIndex = int  # 0 = data node (embedding, head and loss), 1..S-1 = block stages


@dataclass(frozen=True)
class PlanNode:
    """One peer as the planner sees it (what its DHT record advertises)."""

    node_id: NodeId
    stage: StageIndex
    site: int  # index into the Swarm's site tables
    forward_s: float  # forward time of this node's stage for one microbatch
    memory: int  # microbatches whose activations it can hold at once
    bandwidth_Bps: float = math.inf  # the node's own access-link cap, on top of its site's link

    def __post_init__(self) -> None:
        if self.forward_s <= 0 or self.memory < 1 or self.bandwidth_Bps <= 0:
            raise ValueError(f"node {self.node_id}: forward_s, memory and bandwidth must be positive")


@dataclass(frozen=True)
class Swarm:
    """An immutable snapshot: nodes plus one-way latency and bandwidth between every pair of sites."""

    nodes: tuple[PlanNode, ...]
    stages: int
    latency_s: tuple[tuple[float, ...], ...]  # [site_a][site_b], one-way
    bandwidth_Bps: tuple[tuple[float, ...], ...]  # [site_a][site_b], bytes per second
    site_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        n_sites = len(self.latency_s)
        if len(self.bandwidth_Bps) != n_sites or any(len(r) != n_sites for r in self.latency_s):
            raise ValueError("latency and bandwidth tables must both be square over the same sites")
        if any(len(r) != n_sites for r in self.bandwidth_Bps):
            raise ValueError("bandwidth table must be square")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must be unique")
        for n in self.nodes:
            if not 0 <= n.stage < self.stages:
                raise ValueError(f"node {n.node_id} has stage {n.stage}, outside 0..{self.stages - 1}")
            if not 0 <= n.site < n_sites:
                raise ValueError(f"node {n.node_id} sits at unknown site {n.site}")

    @cached_property
    def by_id(self) -> dict[NodeId, PlanNode]:
        return {n.node_id: n for n in self.nodes}

    @cached_property
    def by_stage(self) -> tuple[tuple[PlanNode, ...], ...]:
        """Nodes of each stage, in id order (so every planner iterates deterministically)."""
        groups: list[list[PlanNode]] = [[] for _ in range(self.stages)]
        for n in sorted(self.nodes, key=lambda n: n.node_id):
            groups[n.stage].append(n)
        return tuple(tuple(g) for g in groups)

    @property
    def data_nodes(self) -> tuple[PlanNode, ...]:
        return self.by_stage[0]

    def node(self, node_id: NodeId) -> PlanNode:
        return self.by_id[node_id]

    def latency(self, a: PlanNode, b: PlanNode) -> float:
        return self.latency_s[a.site][b.site]

    def bandwidth(self, a: PlanNode, b: PlanNode) -> float:
        return min(self.bandwidth_Bps[a.site][b.site], a.bandwidth_Bps, b.bandwidth_Bps)

    def with_nodes(self, nodes: tuple[PlanNode, ...]) -> Swarm:
        """The same network with a different set of nodes (after churn or a re-allocation)."""
        return Swarm(nodes, self.stages, self.latency_s, self.bandwidth_Bps, self.site_names)

    def with_stages(self, stage_of: dict[NodeId, StageIndex]) -> Swarm:
        """The same nodes moved to new stages (the output of an allocation)."""
        return self.with_nodes(tuple(replace(n, stage=stage_of.get(n.node_id, n.stage)) for n in self.nodes))
