"""NoLoCo's routing: every microbatch goes through a random live replica of each stage.

The point (papers/noloco.md) is mixing: replicas see each other's activations, which with the
pairwise outer step keeps them close without any all-reduce. Replicas are drawn in proportion to
their speed (1 / forward time), so a slow peer is not handed as much work as a fast one. A lost hop
and a joining node follow GWTF's rules (the base policy).
"""

from __future__ import annotations

from shoal.planning.policy import Policy
from shoal.planning.swarm import NodeId, Swarm


class RandomPolicy(Policy):
    name = "random"

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        hops = []
        for stage in range(1, view.stages):
            replicas = view.by_stage[stage]
            if not replicas:
                return None
            pick = self.rng.choices(replicas, weights=[1.0 / n.forward_s for n in replicas])[0]
            hops.append(pick.node_id)
        return tuple(hops)
