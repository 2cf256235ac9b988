"""A plan for one iteration: each microbatch's route and, when the planner timed it, its timetable."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.planning.swarm import NodeId, Swarm


@dataclass(frozen=True)
class Route:
    """Where one microbatch goes: from its data node through `hops` and back to the same data node.

    Backward retraces the route in reverse, so the route is all a hop needs to know.
    """

    origin: NodeId
    hops: tuple[NodeId, ...]

    def stages(self, swarm: Swarm) -> tuple[int, ...]:
        return tuple(swarm.node(h).stage for h in self.hops)


@dataclass(frozen=True)
class Timing:
    """Planned start times (s) of every compute task of one microbatch.

    A node must not start a task before its planned time: that is how a collision-aware plan makes
    a microbatch wait instead of overlapping another one on a busy node.
    """

    release_s: float  # forward on the data node
    forward_s: tuple[float, ...]  # per hop, in route order
    head_s: float  # loss and LM head back on the data node
    backward_s: tuple[float, ...]  # per hop, in route order (executed in reverse)
    origin_backward_s: float
    end_s: float  # when the data node's backward finishes


@dataclass(frozen=True)
class IterationPlan:
    """Routes for one iteration over `swarm` (which carries the stage allocation the plan assumes)."""

    policy: str
    swarm: Swarm
    routes: tuple[Route, ...]
    timings: tuple[Timing, ...] | None = None

    def __post_init__(self) -> None:
        if self.timings is not None and len(self.timings) != len(self.routes):
            raise ValueError("one timing per route")

    @property
    def predicted_makespan_s(self) -> float | None:
        if not self.timings:
            return None
        return max(t.end_s for t in self.timings) - min(t.release_s for t in self.timings)
