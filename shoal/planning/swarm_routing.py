"""SWARM's routing (Ryabinin et al. 2023), the baseline: each hop picks a replica of the next stage by
expected finish time from throughput averages, blind to the network between the two.

This follows the public code's `ExpertBalancer` (yandex-research/swarm): a per-router queue of
virtual loads; choosing a peer adds task_size / its measured throughput to its load; a peer never
measured costs `initial_s`; a newly seen peer starts at the lowest current load; a failed peer is
dropped. Its throughput is an exponential average of how long this router's requests to it took.
The public code has no adaptive stage rebalancing (its README says "not yet added"); a joining
node here takes the block stage with the least total compute throughput, the paper's rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from shoal.planning.costs import CostModel
from shoal.planning.swarm import NodeId, PlanNode, StageIndex, Swarm


class SwarmBalancer:
    """One router's view of the replicas of one stage. Plain state; the caller supplies the time."""

    def __init__(self, initial_s: float = 1.0, alpha: float = 0.1) -> None:
        self.initial_s, self.alpha = initial_s, alpha
        self.load: dict[NodeId, float] = {}
        self.seconds_per_task: dict[NodeId, float] = {}

    def choose(self, candidates: Sequence[NodeId], rng: random.Random) -> NodeId:
        """The candidate with the lowest expected finish; its load grows by its expected time.

        Ties are broken at random, as SWARM does: otherwise every router, starting from the same
        empty loads, would send its first microbatch to the same replica.
        """
        if not candidates:
            raise ValueError("no replica to choose from")
        live = set(candidates)
        for gone in [n for n in self.load if n not in live]:
            del self.load[gone]
        base = min(self.load.values(), default=0.0)
        for n in candidates:
            self.load.setdefault(n, base)
        pick = min(candidates, key=lambda n: (self.load[n], rng.random()))
        self.load[pick] += self.seconds_per_task.get(pick, self.initial_s)
        return pick

    def observe(self, node: NodeId, seconds: float) -> None:
        """Record how long one request to `node` took (send, queue and compute, as SWARM measures)."""
        old = self.seconds_per_task.get(node)
        self.seconds_per_task[node] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def forget(self, node: NodeId) -> None:
        self.load.pop(node, None)
        self.seconds_per_task.pop(node, None)


def swarm_join_stage(view: Swarm, cost: CostModel, newcomer: PlanNode) -> StageIndex:
    """SWARM's placement: the block stage whose replicas add up to the least compute throughput."""

    def throughput(stage: int) -> float:
        return sum(1.0 / cost.compute_s(n) for n in view.by_stage[stage])

    return min(range(1, view.stages), key=lambda s: (throughput(s), s))
