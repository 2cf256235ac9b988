"""The routing policies: the one seam through which both the daemon and the simulator decide where a
microbatch goes, who redoes a lost hop, and which stage a node takes.

Every decision here is one call into `planning/`; a policy only keeps the state a real node keeps
between calls (its routes, its balancer). A caller that wants the planner's own cost sets `clock`
(the simulator does, to report `scheduler_wall_s`); nothing here reads a clock by itself. The daemon
reaches these through `PeerRouter` (`planning/peer_router.py`), over its SwarmView and the links it
measured.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from shoal.planning.allocation import allocate_stages
from shoal.planning.costs import CostModel
from shoal.planning.dtfm import plan_dtfm
from shoal.planning.gwtf import NeighbourTable, choose_next_hop, onward_s
from shoal.planning.plan import IterationPlan
from shoal.planning.random_skip import plan_random_skip
from shoal.planning.recovery import place_joining_node, replacement_node
from shoal.planning.skippipe import SkipPipeOptions, plan_skippipe
from shoal.planning.swarm import NodeId, PlanNode, StageIndex, Swarm
from shoal.planning.swarm_routing import SwarmBalancer, swarm_join_stage


class Policy:
    """Defaults shared by the route-following policies; the SWARM adapter overrides hop choice."""

    name = "policy"
    hop_by_hop = False  # True: the next hop is chosen when a microbatch leaves a node
    routes_live = True  # False: it plans a whole iteration up front, which a live swarm never holds still for
    joins_by_seniority = False  # True: a live node places itself by assignment.py's rule, not by `place`

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        self.cost, self.rng = cost, rng
        self.wall_s = 0.0
        self.wall_by_call: dict[str, float] = {}  # planner wall time per planning function
        self.plan: IterationPlan | None = None
        self.clock: Callable[[], float] | None = None  # set to time the planner (simulator reports)

    @classmethod
    def create(cls, cost: CostModel, rng: random.Random, options: SkipPipeOptions, allocate: bool) -> Policy:
        """The policy for a run; `options` and `allocate` are for the static planners."""
        return cls(cost, rng)

    def _timed(self, fn, *args, **kwargs):
        if self.clock is None:
            return fn(*args, **kwargs)
        start = self.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = self.clock() - start
            self.wall_s += spent
            name = getattr(fn, "__name__", "planner")
            self.wall_by_call[name] = self.wall_by_call.get(name, 0.0) + spent

    def start(self, view: Swarm, microbatches: int) -> Swarm:
        """Plan before the first injection; returns the swarm with the stages the plan assumes."""
        return view

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        """Route for a microbatch a data node injects now (continuous policies); None: not now."""
        return None

    def finished(self, origin: NodeId, route: tuple[NodeId, ...]) -> None:
        """A microbatch injected on `route` completed or was abandoned (frees its slot)."""

    def next_hop(self, sender: NodeId, stage: StageIndex, view: Swarm, origin: NodeId) -> NodeId | None:
        """Hop-by-hop policies: the replica of `stage` that `sender` passes a microbatch of `origin` to."""
        raise NotImplementedError(f"{self.name} follows planned routes")

    def observe(self, sender: NodeId, receiver: NodeId, stage: StageIndex, seconds: float) -> None:
        """How long a forward request from sender to receiver took (only SWARM listens)."""

    def heard(self, sender: NodeId, receiver: NodeId, load: int, onward_s: float, home: NodeId) -> None:
        """`receiver` answered a forward from `sender` of a microbatch bound for `home` with its load
        and its onward cost there (only GWTF listens)."""

    def returned(self, sender: NodeId, receiver: NodeId) -> None:
        """A gradient came back to `sender` from `receiver`, the hop after it (only GWTF listens)."""

    def advert(self, node: NodeId, view: Swarm, home: NodeId) -> float | None:
        """The onward cost to `home` that `node` tells a sender it answers (GWTF); None: this policy
        sends none."""
        return None

    def replace(
        self,
        view: Swarm,
        stage: StageIndex,
        prev: PlanNode,
        nxt: PlanNode,
        exclude: Collection[NodeId],
        load: Mapping[NodeId, int],
    ) -> NodeId | None:
        node = self._timed(replacement_node, view, self.cost, stage, prev, nxt, exclude, load)
        return None if node is None else node.node_id

    def view_changed(self, view: Swarm) -> None:
        """The set of live nodes changed (a crash detected, a leave announced, a join ready)."""

    def place(self, view: Swarm, newcomer: PlanNode) -> StageIndex:
        return self._timed(place_joining_node, view, self.cost, newcomer)


class StaticPolicy(Policy):
    """DT-FM, random skipping and SkipPipe: one plan for the whole iteration, made up front."""

    routes_live = False

    def __init__(self, cost: CostModel, rng: random.Random, options: SkipPipeOptions, allocate: bool) -> None:
        super().__init__(cost, rng)
        self.options, self.allocate = options, allocate

    @classmethod
    def create(cls, cost: CostModel, rng: random.Random, options: SkipPipeOptions, allocate: bool) -> Policy:
        return cls(cost, rng, options, allocate)

    def start(self, view: Swarm, microbatches: int) -> Swarm:
        if self.allocate:
            sizes = [len(group) for group in view.by_stage]
            allocation = self._timed(allocate_stages, view, self.cost, sizes, self.rng)
            view = view.with_stages(allocation.stage_of)
        self.plan = self._plan(view, microbatches)
        return view

    def _plan(self, view: Swarm, microbatches: int) -> IterationPlan:
        raise NotImplementedError


class DtfmPolicy(StaticPolicy):
    """DT-FM's baseline schedule over the allocation (`planning/dtfm.py`)."""

    name = "dtfm"

    def _plan(self, view: Swarm, microbatches: int) -> IterationPlan:
        return self._timed(plan_dtfm, view, self.cost, microbatches)


class RandomSkipPolicy(StaticPolicy):
    """Full paths that skip a random share of the block stages (`planning/random_skip.py`)."""

    name = "random-skip"

    def _plan(self, view: Swarm, microbatches: int) -> IterationPlan:
        return self._timed(plan_random_skip, view, microbatches, self.options.skip, self.rng)


class SkipPipePolicy(StaticPolicy):
    """SkipPipe's partial paths (`planning/skippipe.py`); without collision awareness, its ablation."""

    name = "skippipe"

    def __init__(self, cost: CostModel, rng: random.Random, options: SkipPipeOptions, allocate: bool) -> None:
        super().__init__(cost, rng, options, allocate)
        self.name = "skippipe" if options.collision_aware else "skippipe-nocollision"

    def _plan(self, view: Swarm, microbatches: int) -> IterationPlan:
        return self._timed(plan_skippipe, view, self.cost, microbatches, self.options, self.rng)


class GwtfPolicy(Policy):
    """GWTF: every sender picks the next hop itself, by its own neighbour table (`planning/gwtf.py`).

    The policy keeps one table per deciding node: the simulator decides for every node, the daemon's
    router for its own node (and guesses the later hops of a route it injects, which the workers
    on the way decide again). A lost hop goes to the cheapest live replica between its neighbours."""

    name = "gwtf"
    hop_by_hop = True

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        super().__init__(cost, rng)
        self.tables: dict[NodeId, NeighbourTable] = {}

    def table(self, node: NodeId) -> NeighbourTable:
        return self.tables.setdefault(node, NeighbourTable())

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        return ()

    def next_hop(self, sender: NodeId, stage: StageIndex, view: Swarm, origin: NodeId) -> NodeId | None:
        node = view.by_id.get(sender)
        if node is None:
            return None
        return self._timed(choose_next_hop, view, self.cost, node, stage, self.table(sender), self.rng, origin)

    def heard(self, sender: NodeId, receiver: NodeId, load: int, onward_s: float, home: NodeId) -> None:
        self.table(sender).heard_from(receiver, load, onward_s, home)

    def returned(self, sender: NodeId, receiver: NodeId) -> None:
        self.table(sender).returned(receiver)

    def advert(self, node: NodeId, view: Swarm, home: NodeId) -> float | None:
        me = view.by_id.get(node)
        return None if me is None else self._timed(onward_s, view, self.cost, me, self.table(node), home)

    def view_changed(self, view: Swarm) -> None:
        for table in self.tables.values():
            table.warm_up(view)


class SwarmPolicy(Policy):
    """SWARM: hop-by-hop choice by each sender's balancer; a lost hop, forward or backward, is retried on
    another replica the balancer picks (as its public client does), so only that hop is redone."""

    name = "swarm"
    hop_by_hop = True

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        super().__init__(cost, rng)
        self.balancers: dict[tuple[NodeId, StageIndex], SwarmBalancer] = {}

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        return ()

    def next_hop(self, sender: NodeId, stage: StageIndex, view: Swarm, origin: NodeId) -> NodeId | None:
        candidates = [n.node_id for n in view.by_stage[stage]]
        if not candidates:
            return None
        balancer = self.balancers.setdefault((sender, stage), SwarmBalancer())
        return self._timed(balancer.choose, candidates, self.rng)

    def observe(self, sender: NodeId, receiver: NodeId, stage: StageIndex, seconds: float) -> None:
        balancer = self.balancers.get((sender, stage))
        if balancer is not None:
            balancer.observe(receiver, seconds)

    def replace(self, view, stage, prev, nxt, exclude, load) -> NodeId | None:
        """A failed forward is re-sent to whichever replica the sender's balancer picks next."""
        candidates = [n.node_id for n in view.by_stage[stage] if n.node_id not in exclude]
        if not candidates:
            return None
        balancer = self.balancers.setdefault((prev.node_id, stage), SwarmBalancer())
        for gone in exclude:
            balancer.forget(gone)
        return self._timed(balancer.choose, candidates, self.rng)

    def place(self, view: Swarm, newcomer: PlanNode) -> StageIndex:
        return self._timed(swarm_join_stage, view, self.cost, newcomer)


class CapacityPolicy(Policy):
    """The daemon's first rule, kept as a baseline: per stage, the replica with the earliest expected
    finish, (microbatches this data node has in flight on it + 1) x its compute time, blind to the
    network. A lost hop goes to the least loaded other replica; a live node joins by assignment.py's
    rule (seniority, then the bottleneck stage)."""

    name = "capacity"
    joins_by_seniority = True

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        super().__init__(cost, rng)
        self.in_use: Counter[NodeId] = Counter()

    def _least_loaded(self, candidates, load: Mapping[NodeId, int]) -> PlanNode | None:
        key = lambda n: ((load.get(n.node_id, 0) + self.in_use[n.node_id] + 1) * n.forward_s, n.node_id)  # noqa: E731
        return min(candidates, key=key, default=None)

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        hops = []
        for stage in range(1, view.stages):
            pick = self._least_loaded(view.by_stage[stage], {})
            if pick is None:
                return None
            hops.append(pick.node_id)
        self.in_use.update(hops)
        return tuple(hops)

    def finished(self, origin: NodeId, route: tuple[NodeId, ...]) -> None:
        self.in_use.subtract(route)

    def replace(self, view, stage, prev, nxt, exclude, load) -> NodeId | None:
        pick = self._least_loaded([n for n in view.by_stage[stage] if n.node_id not in exclude], load)
        return None if pick is None else pick.node_id


class RandomPolicy(Policy):
    """NoLoCo's routing (papers/noloco.md), the daemon's default under NoLoCo: every microbatch goes
    through a random live replica of each stage. The point is mixing: replicas see each other's
    activations, which with the pairwise outer step keeps them close without any all-reduce.
    Replicas are drawn in proportion to their speed (1 / forward time), so a slow peer is not handed
    as much work as a fast one. A lost hop and a joining node follow the base policy's rules."""

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


class FixedLanesPolicy(Policy):
    """Data-parallel pipelines that never mix, the baseline of NoLoCo's routing ablation
    (papers/noloco.md §3: random routing lowers the spread between replicas). Each stage's replicas
    are ranked by node id and microbatch k goes through rank k mod r of every stage, r being the
    fewest replicas any stage has: replica i of one stage only ever feeds replica i of the next.
    Replicas ranked r or higher get no work; a view change re-ranks the lanes."""

    name = "fixed"

    def __init__(self, cost: CostModel, rng: random.Random) -> None:
        super().__init__(cost, rng)
        self.injected = 0

    def new_route(self, origin: NodeId, view: Swarm) -> tuple[NodeId, ...] | None:
        ranked = [sorted(n.node_id for n in view.by_stage[stage]) for stage in range(1, view.stages)]
        if not all(ranked):
            return None
        lane = self.injected % min(len(ids) for ids in ranked)
        self.injected += 1
        return tuple(ids[lane] for ids in ranked)


POLICIES: dict[str, type[Policy]] = {
    "dtfm": DtfmPolicy,
    "random-skip": RandomSkipPolicy,
    "skippipe": SkipPipePolicy,
    "swarm": SwarmPolicy,
    "gwtf": GwtfPolicy,
    "capacity": CapacityPolicy,
    "random": RandomPolicy,
    "fixed": FixedLanesPolicy,
}
"""Every policy by the name the simulator's `--policy` and the daemon's `--routing` take it by."""

ROUTING_POLICIES = tuple(name for name, policy in POLICIES.items() if policy.routes_live)
"""The policies a live node can route by (`--routing`)."""


def make_policy(
    name: str,
    cost: CostModel,
    rng: random.Random,
    options: SkipPipeOptions | None = None,
    allocate: bool = True,
) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name].create(cost, rng, options or SkipPipeOptions(), allocate)


def join_stage(policy: Policy, view: Swarm, newcomer: PlanNode) -> StageIndex:
    """The block stage a node joining `view` takes under `policy`: a stage left with no replica first
    (the lowest; until it is filled no microbatch gets through), else the policy's own placement. The
    daemon's router comes here once the rules of a live view are settled (planning/peer_router.py);
    the simulator places its joiners here."""
    empty = [stage for stage in range(1, view.stages) if not view.by_stage[stage]]
    if empty:
        return empty[0]
    return policy.place(view, newcomer)
