"""The time model every planner and the simulator share: compute per task, transfer per hop.

Kept in one place so a plan's predicted timing and the simulator's virtual clock can never
disagree about what a hop costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.planning.swarm import PlanNode, Swarm


@dataclass(frozen=True)
class CostModel:
    """Per-microbatch sizes and the compute ratios of the SkipPipe authors' emulator.

    Backward costs 1.5x the stage's forward; the data node's loss plus LM head costs 0.25x its
    forward (both from gensyn-ai/skippipe). A gradient is as large as the activation it answers.
    """

    activation_bytes: float
    per_hop_overhead_s: float = 0.0  # fixed cost of one send (serialisation, RPC), on top of the link
    backward_factor: float = 1.5
    head_factor: float = 0.25

    def transfer_s(self, swarm: Swarm, a: PlanNode, b: PlanNode) -> float:
        """Seconds to move one activation (or gradient) from a to b; nothing within a node."""
        if a.node_id == b.node_id:
            return 0.0
        bandwidth = min(swarm.bandwidth_Bps[a.site][b.site], a.bandwidth_Bps, b.bandwidth_Bps)  # = swarm.bandwidth
        return self.per_hop_overhead_s + swarm.latency_s[a.site][b.site] + self.activation_bytes / bandwidth

    def backward_s(self, node: PlanNode) -> float:
        return self.backward_factor * node.forward_s

    def head_s(self, node: PlanNode) -> float:
        """Loss, final norm and LM head (forward and backward) on a data node."""
        return self.head_factor * node.forward_s

    def compute_s(self, node: PlanNode) -> float:
        """All compute one microbatch costs on this node: forward and backward, plus the head on stage 0."""
        total = node.forward_s + self.backward_s(node)
        return total + self.head_s(node) if node.stage == 0 else total
