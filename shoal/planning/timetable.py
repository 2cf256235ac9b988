"""SkipPipe's timetable across data nodes: one plan per step that every data node computes alike.

SkipPipe avoids collisions by planning every microbatch of an iteration together, from all data
nodes, and timing each task (papers/skippipe.md, rule 3). A data node that planned only its own
paths would book the workers' time as if no other data node used them. Here no node publishes a
plan: each data node computes the step's plan for the whole swarm from inputs they all share (the
swarm as the DHT advertises it, peers numbered in peer-id order, the random stream seeded by run
and step) and keeps its own paths with their release times. Plans agree while the data nodes' views
do; `digest` tells whether they did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from shoal.planning.costs import CostModel
from shoal.planning.from_view import swarm_from_view
from shoal.planning.plan import IterationPlan
from shoal.planning.skippipe import PlanningError, SkipPipeOptions, plan_skippipe
from shoal.planning.swarm import NodeId, Swarm
from shoal.planning.swarm_view import STATE_ACTIVE, STATE_JOINING, PeerID, StageIndex, SwarmView

MIN_PLANNED_LATENCY_S = 0.01  # links faster than this are one site to the timetable


@dataclass(frozen=True)
class PlannedPath:
    """One microbatch's path, (stage, peer) per visited block stage, and its timetable: when to
    release it, and when each hop starts its forward and its backward (seconds after the step's start)."""

    hops: tuple[tuple[StageIndex, PeerID], ...]
    release_s: float
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepTimetable:
    swarm: Swarm  # what was planned over (the simulator can replay it: `shoal.sim`)
    plan: IterationPlan
    peers: dict[NodeId, PeerID]

    def paths_of(self, origin: PeerID) -> list[PlannedPath]:
        """`origin`'s paths in release order, release times counted from the plan's first release."""
        assert self.plan.timings is not None, "a timetable is a timed plan"
        first = min((t.release_s for t in self.plan.timings), default=0.0)
        mine = [
            PlannedPath(
                tuple((self.swarm.node(h).stage, self.peers[h]) for h in route.hops),
                timing.release_s - first,
                tuple(t - first for t in timing.forward_s),
                tuple(t - first for t in timing.backward_s),
            )
            for route, timing in zip(self.plan.routes, self.plan.timings, strict=True)
            if self.peers[route.origin] == origin
        ]
        return sorted(mine, key=lambda p: p.release_s)

    @property
    def digest(self) -> str:
        """The plan in 12 hex digits: data nodes that planned alike report the same."""
        assert self.plan.timings is not None
        text = ";".join(
            f"{self.peers[r.origin]}>{','.join(self.peers[h] for h in r.hops)}@{t.release_s:.4f}"
            for r, t in zip(self.plan.routes, self.plan.timings, strict=True)
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def step_timetable(
    view: SwarmView,
    cost: CostModel,
    run_id: str,
    step: int,
    per_data_node: int,
    options: SkipPipeOptions,
    exclude: Collection[PeerID] = (),
) -> StepTimetable | None:
    """Step `step`'s collision-aware plan over `shared_swarm(view, cost, exclude)` (`plan_step`)."""
    swarm, ids = shared_swarm(view, cost, exclude)
    return plan_step(swarm, ids, cost, run_id, step, per_data_node, options)


def plan_step(
    swarm: Swarm,
    ids: Mapping[PeerID, NodeId],
    cost: CostModel,
    run_id: str,
    step: int,
    per_data_node: int,
    options: SkipPipeOptions,
) -> StepTimetable | None:
    """Step `step`'s collision-aware plan for every data node's `per_data_node` microbatches over
    `swarm` (peer `p` is node `ids[p]`); None while some stage has nobody (or no plan fits). Only what
    every data node has alike goes in: the shared swarm, and a seed from the run and the step."""
    if any(not group for group in swarm.by_stage):
        return None
    options = dataclasses.replace(options, collision_aware=True)
    try:
        plan = plan_skippipe(
            swarm, cost, per_data_node * len(swarm.data_nodes), options, random.Random(f"skippipe:{run_id}:{step}")
        )
    except PlanningError:
        return None
    if plan.timings is None:
        return None
    return StepTimetable(swarm, plan, {node_id: peer for peer, node_id in ids.items()})


def shared_swarm(
    view: SwarmView, cost: CostModel, exclude: Collection[PeerID] = ()
) -> tuple[Swarm, dict[PeerID, NodeId]]:
    """The planning swarm every data node builds alike from `view`: its active workers and its data
    nodes, active or joining, less `exclude`, numbered in peer-id order, with throughputs as advertised
    rounded to a power of two, and links as advertised rounded to a power of ten.

    Latencies under 10 ms, and links nobody has measured yet, are taken as 10 ms (one site): a hop is
    held for its planned start, so a plan that assumed the 100 ms of an unknown link held every hop
    that long (steps took 0.74 s where the same paths sent at once took 0.47). The rounding: peers
    re-measure and re-advertise every heartbeat, and two data nodes that read the view a moment apart
    would otherwise plan from figures apart by more than the plan can tell (seen on loopback:
    latencies of 2-30 ms from one heartbeat to the next). A joining data node counts: it sees its own
    record turn active before the others do (seen: one data node planned without the other for 10
    steps)."""
    inactive = [
        n.peer_id for n in view.nodes if n.state != STATE_ACTIVE and not (n.stage == 0 and n.state == STATE_JOINING)
    ]
    view = view.without([*inactive, *exclude])
    view = view.with_throughput({n.peer_id: binned(n.block_throughput) for n in view.nodes})
    links = {
        pair: (binned(max(latency, MIN_PLANNED_LATENCY_S), 10.0), binned(bandwidth, 10.0))
        for pair, (latency, bandwidth) in view.measured_links().items()
    }
    return swarm_from_view(view, cost, links, default_latency_s=MIN_PLANNED_LATENCY_S)


def binned(value: float, base: float = 2.0) -> float:
    """`value` rounded to the nearest power of `base` (0 and below: as is, "not measured")."""
    return base ** round(math.log(value, base)) if value > 0 else value


def reads_swarm(step: int, every: int) -> bool:
    """Whether a data node reads the swarm afresh before `step` for the timetables of the steps up to
    the next full pass: at the first step and right after each full pass (every 10 steps without one).
    Data nodes step together, so they read the DHT within moments of each other and plan alike."""
    return step % (every or 10) == 0


def full_pass_step(step: int, every: int) -> bool:
    """Whether `step` (from 0) is one of SkipPipe's periodic full passes: every `every`th step, the
    10th, 20th, ... (0: never)."""
    return every > 0 and (step + 1) % every == 0
