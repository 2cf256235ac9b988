"""Mutable simulation state: tasks, nodes and microbatches as the event loop sees them."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.planning.plan import Timing
from shoal.planning.swarm import NodeId, PlanNode

ORIGIN = -1  # route position of the data node (first and last)


@dataclass(eq=False)
class Task:
    mb: int
    epoch: int
    kind: str  # "fwd", "head" (loss + LM head on the data node) or "bwd"
    hop: int  # route position, ORIGIN for the data node
    ready_s: float  # when the node could have started it (arrived, admitted, eligible)
    not_before: float = 0.0  # planned start, for collision-aware plans


@dataclass(eq=False)
class Node:
    info: PlanNode
    born_s: float = 0.0
    alive: bool = True
    accepting: bool = True  # False once leaving: serves what it holds, admits nothing new
    resident: set[int] = field(default_factory=set)  # microbatches whose activations it holds
    # activations waiting for memory, a heap of (planned start or arrival, mb, epoch, hop, arrived)
    waiting: list[tuple[float, int, int, int, float]] = field(default_factory=list)
    queue: list[tuple[tuple, int, Task]] = field(default_factory=list)  # heap of eligible tasks
    sleeping: int = 0  # tasks waiting for their planned start
    current: Task | None = None
    started_s: float = 0.0
    duration_s: float = 0.0
    busy_s: float = 0.0
    gone_s: float | None = None

    @property
    def node_id(self) -> NodeId:
        return self.info.node_id

    @property
    def has_room(self) -> bool:
        return len(self.resident) < self.info.memory


@dataclass(eq=False)
class Microbatch:
    mb_id: int
    origin: NodeId
    route: list[NodeId | None]  # block-stage nodes by position; None until a hop-by-hop router picks
    stages: list[int]
    timing: Timing | None
    injected_route: tuple[NodeId, ...]  # as handed out, to free the policy's slot at the end
    status: str = "queued"  # queued (at its data node), active, completed, abandoned
    epoch: int = 0  # bumped on restart; events of an older epoch are ignored
    planned: set[int] = field(default_factory=set)  # positions whose planned start times still apply
    work: dict[int, float] = field(default_factory=dict)  # compute seconds done per position, this epoch
    holders: set[NodeId] = field(default_factory=set)
    step: tuple[str, int] | None = None  # the compute step it waits for, and where
    step_node: NodeId | None = None
    token: int = 0  # changes whenever `step` does, so a stale failure detection is ignored
    sent_s: float = 0.0  # when its last forward left (SWARM's request timing)
    recompute_until: int | None = None  # position whose backward follows a recomputed forward
    grad_ready_s: float = 0.0  # when the re-sent gradient reaches that position

    @property
    def live(self) -> bool:
        return self.status in ("queued", "active")
