"""Which stage a node takes: fill empty stages first, then strengthen the bottleneck.

Nodes decide alone from the same view, so two that join together would pick the same empty slot.
Every rule therefore breaks ties by seniority (`started_at`, then peer id): when several nodes
claim a slot that needs fewer, the most senior keep it and the others move on; and of the holders
of one stage only the most junior may leave it in one round, so nodes that see the same view do
not all move together and flap. The swarm converges without a coordinator. Like Petals' block
selection, a node that already holds a stage moves for throughput only when that raises the slowest
stage by a clear margin (`hysteresis`), so replicas do not flap on noisy throughput figures.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shoal.planning.swarm_view import ROLE_DATA, NodeInfo, PeerID, StageIndex, SwarmView


@dataclass(frozen=True)
class Candidate:
    """This node, as the assignment sees it."""

    peer_id: PeerID
    block_throughput: float
    started_at: float
    role: str = "auto"  # "data", "worker" or "auto"
    current_stage: StageIndex | None = None
    stages_that_fit: frozenset[StageIndex] | None = None  # those its memory holds (None: every stage)

    def fits(self, stage: StageIndex) -> bool:
        return self.stages_that_fit is None or stage in self.stages_that_fit


def _seniority(node: NodeInfo | Candidate) -> tuple[float, str]:
    return (node.started_at, node.peer_id)


def _outranked(view: SwarmView, me: Candidate, stage: StageIndex, seats: int) -> bool:
    """Whether `seats` more senior nodes already hold `stage`."""
    senior = [n for n in view.replicas(stage, exclude=me.peer_id) if _seniority(n) < _seniority(me)]
    return len(senior) >= seats


def _holders(view: SwarmView, me: Candidate, stage: StageIndex) -> int:
    """Live holders of `stage`, this node included."""
    return len(view.replicas(stage, exclude=me.peer_id)) + 1


def _junior_rank(view: SwarmView, me: Candidate, stage: StageIndex) -> int:
    """How many holders of `stage` are more junior than this node (0: it is the most junior)."""
    return sum(1 for n in view.replicas(stage, exclude=me.peer_id) if _seniority(n) > _seniority(me))


def _tie_break(peer_id: PeerID, stage: StageIndex) -> bytes:
    # spreads simultaneous joiners over equally good stages instead of piling them on one
    return hashlib.sha256(f"{peer_id}:{stage}".encode()).digest()


def takes_data_role(view: SwarmView, me: Candidate, min_data_nodes: int = 1) -> bool:
    if me.role == ROLE_DATA:
        return True
    if me.role != "auto" or not me.fits(0):
        return False
    if me.current_stage == 0:
        return not _outranked(view, me, 0, min_data_nodes)
    return len(view.replicas(0, exclude=me.peer_id)) < min_data_nodes


def choose_stage(view: SwarmView, me: Candidate, hysteresis: float = 0.2, min_data_nodes: int = 1) -> StageIndex:
    """The stage this node should hold now, given the live swarm (which may include itself)."""
    if takes_data_role(view, me, min_data_nodes):
        return 0
    block_stages = [s for s in range(1, view.stages) if me.fits(s)]
    if not block_stages:
        return 0  # only stage 0 fits its memory: one more data node
    current = me.current_stage if me.current_stage in block_stages else None
    empty = [s for s in block_stages if not view.replicas(s, exclude=me.peer_id)]
    if current is not None:
        if current in empty:
            return current  # its only holder: staying keeps the pipeline whole
        if empty:
            # Only as many of its holders as there are empty stages move, the most junior first, and
            # the most senior always stays: all moving at once would empty this stage in turn.
            rank = _junior_rank(view, me, current)
            if rank >= min(len(empty), _holders(view, me, current) - 1):
                return current
            return sorted(empty)[rank]
    if empty:
        return min(empty, key=lambda s: _tie_break(me.peer_id, s))

    def bottleneck_if(stage: StageIndex | None) -> float:
        rates = []
        for s in range(1, view.stages):
            rate = view.stage_throughput(s, exclude=me.peer_id)
            if s == stage:
                rate += me.block_throughput / max(1, view.blocks_per_stage[s])
            rates.append(rate)
        return min(rates)

    best = max(block_stages, key=lambda s: (bottleneck_if(s), _tie_break(me.peer_id, s)))
    if current is None:
        return best
    if _junior_rank(view, me, current) > 0:
        return current  # one move per stage per round: the most junior holder goes, the rest see the result
    if bottleneck_if(best) > (1.0 + hysteresis) * bottleneck_if(current):
        return best
    return current
