"""The daemon's side of the policy seam: one node's routing decisions, in peer ids.

A node knows a `Snapshot`: the SwarmView (who holds which stage, how fast, how much memory) and the
links measured so far (by itself, and as other peers advertise them). `PeerRouter` turns that into
the planning `Swarm` the policies of `policy.py` take, keeps the policy's state across calls (GWTF's
neighbour tables, SWARM's balancers) with node ids that stay stable across views, and answers in peer ids.
The simulator drives the same policies over its own swarm: one algorithm, one place.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from shoal.planning.assignment import Candidate, choose_stage, takes_data_role
from shoal.planning.costs import CostModel
from shoal.planning.from_view import swarm_from_view
from shoal.planning.policy import ROUTING_POLICIES, Policy, join_stage, make_policy
from shoal.planning.skippipe import PlanningError, SkipPipeOptions, plan_skippipe
from shoal.planning.swarm import NodeId, PlanNode, Swarm
from shoal.planning.swarm_view import STATE_ACTIVE, PeerID, StageIndex, SwarmView

Link = tuple[float, float]  # (one-way latency s, bandwidth B/s)
PeerRoute = tuple[tuple[StageIndex, PeerID], ...]


@dataclass(frozen=True)
class Snapshot:
    """What one node knows when it decides: the view and the measured links, (from, to) -> Link."""

    view: SwarmView
    me: PeerID
    links: Mapping[tuple[PeerID, PeerID], Link] = field(default_factory=dict)


@dataclass(frozen=True)
class Routed:
    """A route handed out, with what the policy planned (to give its slot back with `end`)."""

    hops: PeerRoute
    origin: NodeId
    planned: tuple[NodeId, ...]
    # SkipPipe's timetable: each hop's planned forward and backward start, seconds after the step's
    # start (`shoal.planning.timetable`); () = none
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()


class PeerRouter:
    def __init__(self, policy_name: str, cost: CostModel, seed: int | str = 0):
        if policy_name not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing {policy_name!r}; choose from {', '.join(ROUTING_POLICIES)}")
        rng = random.Random(f"route:{seed}")
        self.policy: Policy = make_policy(policy_name, cost, rng, allocate=False)
        self.cost = cost
        self.paths_rng = random.Random(f"paths:{seed}")
        self.swarm: Swarm | None = None
        self._next_id = itertools.count()
        self.ids: dict[PeerID, NodeId] = {}  # every peer ever seen keeps its id
        self.peers: dict[NodeId, PeerID] = {}
        self._members: frozenset[PeerID] = frozenset()
        self.replans = 0

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def hop_by_hop(self) -> bool:
        """Whether each sender picks the next hop itself (SWARM) instead of following the route."""
        return self.policy.hop_by_hop

    def update(self, snapshot: Snapshot) -> None:
        """Take a new snapshot; the policy re-plans only when the set of active peers changed. A peer
        still joining (copying its stage's weights) is not routed to until it says it is active."""
        for node in snapshot.view.live_nodes():
            if node.peer_id not in self.ids:
                self.ids[node.peer_id] = next(self._next_id)
                self.peers[self.ids[node.peer_id]] = node.peer_id
        joining = [n.peer_id for n in snapshot.view.nodes if n.state != STATE_ACTIVE and n.peer_id != snapshot.me]
        view = snapshot.view.without(joining)
        self.swarm, _ = swarm_from_view(view, self.cost, snapshot.links, node_ids=self.ids)
        members = frozenset(n.peer_id for n in view.live_nodes())
        if members != self._members and all(self.swarm.by_stage[1:]):
            if self.replans == 0:
                self.policy.start(self.swarm, 0)
            else:
                self.policy.view_changed(self.swarm)
            self.replans += 1
            self._members = members

    def _live(self, peer: PeerID) -> bool:
        return self.swarm is not None and self.ids.get(peer) in self.swarm.by_id

    def _without(self, exclude: Collection[PeerID]) -> Swarm:
        assert self.swarm is not None, "update() first"
        gone = {self.ids[p] for p in exclude if p in self.ids}
        return self.swarm.with_nodes(tuple(n for n in self.swarm.nodes if n.node_id not in gone))

    def route(self, origin: PeerID, exclude: Collection[PeerID] = ()) -> Routed | None:
        """The route of the next microbatch `origin` injects, one (stage, peer) per block stage, or
        None while some stage has no live replica outside `exclude`. Planned hops through excluded
        peers are replaced by the policy's replacement rule. Give it back with `end`."""
        if self.swarm is None or not self._live(origin):
            return None
        swarm, me = self.swarm, self.ids[origin]
        if self.policy.hop_by_hop:
            hops: list[PeerID] = []
            for stage in range(1, swarm.stages):
                pick = self.next_hop(hops[-1] if hops else origin, stage, origin, exclude)
                if pick is None:
                    return None
                hops.append(pick)
            return Routed(tuple(enumerate(hops, start=1)), me, ())
        planned = self.policy.new_route(me, swarm)
        if planned is None:
            return None
        route: list[tuple[StageIndex, PeerID]] = []
        for position, node_id in enumerate(planned):
            stage, peer = position + 1, self.peers[node_id]
            if peer in exclude or not self._live(peer):
                prev = route[-1][1] if route else origin
                nxt = self.peers[planned[position + 1]] if position + 1 < len(planned) else origin
                peer = self.replace(stage, prev, nxt, exclude)
                if peer is None:
                    self.policy.finished(me, planned)
                    return None
            route.append((stage, peer))
        return Routed(tuple(route), me, planned)

    def plan_paths(self, origin: PeerID, microbatches: int, options: SkipPipeOptions) -> list[Routed] | None:
        """SkipPipe: partial (and, with swaps, reordered) paths for this data node's next
        `microbatches`, planned over the live workers; None while some block stage has nobody."""
        if self.swarm is None or not self._live(origin) or any(not group for group in self.swarm.by_stage[1:]):
            return None
        me = self.ids[origin]
        swarm = self.swarm.with_nodes(tuple(n for n in self.swarm.nodes if n.stage > 0 or n.node_id == me))
        try:
            plan = plan_skippipe(swarm, self.cost, microbatches, options, self.paths_rng)
        except PlanningError:
            return None
        return [Routed(tuple((swarm.node(h).stage, self.peers[h]) for h in r.hops), me, ()) for r in plan.routes]

    def end(self, routed: Routed) -> None:
        """A microbatch injected on `routed` is over (completed, or its attempt lost)."""
        if routed.planned:
            self.policy.finished(routed.origin, routed.planned)

    def next_hop(
        self, sender: PeerID, stage: StageIndex, origin: PeerID, exclude: Collection[PeerID] = ()
    ) -> PeerID | None:
        """The replica of `stage` the sender picks for the next hop (SWARM: by its balancer; GWTF: by
        its neighbour table)."""
        if self.swarm is None or not self._live(sender):
            return self._any_replica(stage, exclude)
        if origin not in self.ids:
            return self._any_replica(stage, exclude)
        pick = self.policy.next_hop(self.ids[sender], stage, self._without(exclude), self.ids[origin])
        return None if pick is None else self.peers[pick]

    def replace(
        self,
        stage: StageIndex,
        prev: PeerID,
        nxt: PeerID,
        exclude: Collection[PeerID],
        load: Mapping[PeerID, int] | None = None,
    ) -> PeerID | None:
        """Another live replica of `stage` to take over a hop between `prev` and `nxt`, or None."""
        if self.swarm is None or not self._live(prev) or not self._live(nxt):
            return self._any_replica(stage, exclude)
        swarm = self.swarm
        node_load = {self.ids[p]: n for p, n in (load or {}).items() if p in self.ids}
        excluded = {self.ids[p] for p in exclude if p in self.ids}
        prev_node, next_node = swarm.node(self.ids[prev]), swarm.node(self.ids[nxt])
        pick = self.policy.replace(swarm, stage, prev_node, next_node, excluded, node_load)
        return None if pick is None else self.peers[pick]

    def _any_replica(self, stage: StageIndex, exclude: Collection[PeerID]) -> PeerID | None:
        if self.swarm is None or stage >= self.swarm.stages:
            return None
        left = [n for n in self.swarm.by_stage[stage] if self.peers[n.node_id] not in exclude]
        return None if not left else self.peers[min(left, key=lambda n: (n.forward_s, n.node_id)).node_id]

    def observe(self, sender: PeerID, receiver: PeerID, stage: StageIndex, seconds: float) -> None:
        """How long a request from sender to receiver took (SWARM's balancer learns from it)."""
        if sender in self.ids and receiver in self.ids:
            self.policy.observe(self.ids[sender], self.ids[receiver], stage, seconds)

    def heard(self, sender: PeerID, receiver: PeerID, load: int, onward_s: float, home: PeerID) -> None:
        """`receiver` answered a forward from `sender` of a microbatch of data node `home` with its load
        and its onward cost there (GWTF learns it)."""
        if sender in self.ids and receiver in self.ids and home in self.ids:
            self.policy.heard(self.ids[sender], self.ids[receiver], load, onward_s, self.ids[home])

    def returned(self, sender: PeerID, receiver: PeerID) -> None:
        """A gradient came back to `sender` from `receiver`, the hop after it (GWTF learns it)."""
        if sender in self.ids and receiver in self.ids:
            self.policy.returned(self.ids[sender], self.ids[receiver])

    def advert(self, me: PeerID, home: PeerID) -> float | None:
        """What `me` tells a sender whose forward of data node `home`'s microbatch it takes: its onward
        cost there (GWTF); None otherwise."""
        if self.swarm is None or not self._live(me) or not self._live(home):
            return None
        return self.policy.advert(self.ids[me], self.swarm, self.ids[home])

    def place(self, view: SwarmView, me: Candidate, forward_s: float, memory: int) -> StageIndex:
        """The stage for this node. The data role and empty stages come first, settled by seniority
        (assignment.py), so simultaneous joiners converge; a node that already holds a block stage
        keeps the hysteresis rule there. Otherwise the policy places it, as it places the simulator's
        joiners (`join_stage`; GWTF: where greedy routes' estimated throughput gains the most; SWARM: the
        stage with the least compute)."""
        limited = me.stages_that_fit is not None and len(me.stages_that_fit) < view.stages
        if self.policy.joins_by_seniority or limited or takes_data_role(view, me) or me.current_stage not in (None, 0):
            return choose_stage(view, me)
        if any(not view.replicas(s, exclude=me.peer_id) for s in range(1, view.stages)):
            return choose_stage(view, me)
        if self.swarm is None or me.peer_id not in self.ids or not self._live(me.peer_id):
            return choose_stage(view, me)
        others = self._without([me.peer_id])
        site = self.swarm.node(self.ids[me.peer_id]).site
        newcomer = PlanNode(max(self.peers) + 1, 1, site, forward_s, max(1, memory))
        return join_stage(self.policy, others, newcomer)
