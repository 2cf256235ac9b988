"""GWTF ("Go With The Flow", Blagoev et al. 2025): every node routes its own microbatches, hop by hop.

The paper gives the hop cost d_ij and the objective (the least maximum route cost, within each
node's capacity, found with local knowledge only); it publishes neither code nor the local moves, so
the rest is our interpretation, stated here (papers/gwtf.md, "shoal's interpretation"):

- A node that has a microbatch to send on (a data node injecting one, a worker done with its
  forward) picks the replica j of the next stage with the least arrival cost from where it sits:
  d_ij + j's queue (its load x its compute) + j's onward cost (what it costs to get the microbatch
  home from j). Replicas with room come first: a full one is taken only when all are.
- What a node knows of a neighbour comes from the neighbour itself: every answer to a forward
  carries the receiver's load and its onward cost (which it works out the same way, from what *its*
  neighbours told it: a distance vector, one hop at a time). Between answers the sender counts its
  own sends since the last one, and one fewer each time a gradient comes back from that neighbour.
  A neighbour never heard from is costed from the view alone, with every queue empty.
- The annealing: at each decision one other replica with room is proposed and taken instead of the
  cheapest with probability exp(-delta / T), delta its extra cost; T starts at 5 % of the cheapest
  arrival cost and cools geometrically to a thousandth of that over `ANNEAL_DECISIONS`, and warms up
  again when the swarm changes. It keeps a node sampling near-equal replicas (so it hears from
  them) where greedy picks alone would lock onto one.
- Onward costs are per data node: an answer is about one microbatch, and says what getting it home
  to its own data node costs; at the last block stage that is the hop home.

No node plans a route for the swarm, and none knows another's decisions: capacity holds because
every sender sees each replica's load as the replica itself reports it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection
from itertools import pairwise

from shoal.planning.costs import CostModel
from shoal.planning.plan import Route
from shoal.planning.swarm import NodeId, PlanNode, StageIndex, Swarm

ANNEAL_T0 = 0.05  # the starting temperature, as a fraction of the cheapest arrival cost
ANNEAL_DECISIONS = 200  # decisions over which the temperature cools to ANNEAL_T0 / 1000


def hop_cost(swarm: Swarm, cost: CostModel, a: PlanNode, b: PlanNode) -> float:
    """GWTF's d_ij = (c_i + c_j)/2 + (lat_ij + lat_ji)/2 + 2 * size / (bw_ij + bw_ji).

    Every link carries the activation forward and the gradient back, hence both directions. c is
    the node's whole compute for one microbatch (forward + backward, plus the head on a data node).
    """
    compute = (cost.compute_s(a) + cost.compute_s(b)) / 2.0
    latency = (swarm.latency(a, b) + swarm.latency(b, a)) / 2.0
    transfer = 2.0 * cost.activation_bytes / (swarm.bandwidth(a, b) + swarm.bandwidth(b, a))
    return compute + latency + transfer


def path_cost(swarm: Swarm, cost: CostModel, route: Route) -> float:
    """Summed hop costs of a route, including the hops out of and back into its data node."""
    chain = [route.origin, *route.hops, route.origin]
    return sum(hop_cost(swarm, cost, swarm.node(a), swarm.node(b)) for a, b in pairwise(chain))


class NeighbourTable:
    """One node's GWTF knowledge: what each neighbour said in its last answer, and what was sent since.

    A neighbour's load is one number; its onward cost depends on where the microbatch goes home to,
    so it is kept per data node (each answer is about one microbatch, whose data node it names).
    Plain state, no clock: the caller reports what happened (`sent`, `heard_from`, `returned`)."""

    def __init__(self) -> None:
        self.load: dict[NodeId, int] = {}  # neighbour -> the load it answered last
        self.onward: dict[tuple[NodeId, NodeId], float] = {}  # (neighbour, home) -> onward cost s answered
        self.unanswered: Counter[NodeId] = Counter()  # sent to it since, not yet answered
        self.decisions = 0  # since the last warm-up: the annealing's clock
        self._unloaded: tuple[Swarm, dict[NodeId, dict[NodeId, float]]] | None = None

    def sent(self, node: NodeId) -> None:
        self.unanswered[node] += 1
        self.decisions += 1

    def heard_from(self, node: NodeId, load: int, onward_s: float, home: NodeId) -> None:
        """`node` took a forward going home to `home`: it now holds `load` microbatches, and gets one
        home from there in `onward_s`."""
        self.load[node] = max(0, load)
        self.onward[(node, home)] = max(0.0, onward_s)
        if self.unanswered[node] > 0:
            self.unanswered[node] -= 1

    def returned(self, node: NodeId) -> None:
        """A gradient came back from `node`: it holds one microbatch fewer than it last said."""
        if node in self.load:
            self.load[node] = max(0, self.load[node] - 1)

    def warm_up(self, view: Swarm) -> None:
        """The swarm changed: forget the nodes it lost, and anneal afresh."""
        self.decisions = 0
        self.load = {n: v for n, v in self.load.items() if n in view.by_id}
        self.onward = {k: v for k, v in self.onward.items() if k[0] in view.by_id and k[1] in view.by_id}
        self.unanswered = Counter({n: v for n, v in self.unanswered.items() if n in view.by_id})

    def load_of(self, node: NodeId) -> int:
        return self.load.get(node, 0) + self.unanswered[node]

    def onward_of(self, view: Swarm, cost: CostModel, node: NodeId, home: NodeId) -> float:
        if (node, home) in self.onward:
            return self.onward[(node, home)]
        if self._unloaded is None or self._unloaded[0] is not view:
            self._unloaded = (view, {})
        by_home = self._unloaded[1]
        if home not in by_home:
            by_home[home] = unloaded_onward_s(view, cost, home)
        return by_home[home].get(node, 0.0)

    def temperature(self, cheapest_s: float) -> float:
        return ANNEAL_T0 * cheapest_s * 1e-3 ** min(1.0, self.decisions / ANNEAL_DECISIONS)


def home_s(view: Swarm, cost: CostModel, node: PlanNode, home: NodeId) -> float:
    """The last block stage's way on: the hop back to the data node the microbatch came from."""
    return hop_cost(view, cost, node, view.node(home)) if home in view.by_id else 0.0


def unloaded_onward_s(view: Swarm, cost: CostModel, home: NodeId) -> dict[NodeId, float]:
    """Every block node's onward cost home to `home` from the view alone, every queue empty."""
    onward: dict[NodeId, float] = {}
    for stage in range(view.stages - 1, 0, -1):
        for node in view.by_stage[stage]:
            if stage == view.stages - 1:
                onward[node.node_id] = home_s(view, cost, node, home)
            else:
                nxt = view.by_stage[stage + 1]
                onward[node.node_id] = min(
                    (hop_cost(view, cost, node, j) + onward[j.node_id] for j in nxt), default=math.inf
                )
    return onward


def arrival_s(
    view: Swarm, cost: CostModel, sender: PlanNode, node: PlanNode, table: NeighbourTable, home: NodeId
) -> float:
    """What sending a microbatch bound for `home` from `sender` on through `node` costs, by what
    `sender` knows."""
    queue = table.load_of(node.node_id) * cost.compute_s(node)
    return hop_cost(view, cost, sender, node) + queue + table.onward_of(view, cost, node.node_id, home)


def onward_s(view: Swarm, cost: CostModel, node: PlanNode, table: NeighbourTable, home: NodeId) -> float:
    """What `node` answers a sender whose microbatch goes home to `home`: the cheapest way there from
    it, by what it knows."""
    if node.stage == view.stages - 1:
        return home_s(view, cost, node, home)
    nxt = view.by_stage[node.stage + 1] if node.stage + 1 < view.stages else ()
    return min((arrival_s(view, cost, node, j, table, home) for j in nxt), default=0.0)


def choose_next_hop(
    view: Swarm,
    cost: CostModel,
    sender: PlanNode,
    stage: StageIndex,
    table: NeighbourTable,
    rng: random.Random,
    home: NodeId,
    exclude: Collection[NodeId] = (),
) -> NodeId | None:
    """The replica of `stage` that `sender` sends its next microbatch (bound for `home`) to, or None
    if there is none.

    The cheapest arrival among replicas with room (all of them if none has room), or, with the
    annealing's probability, one other replica with room proposed at random. Counts the send."""
    replicas = [n for n in view.by_stage[stage] if n.node_id not in exclude]
    if not replicas:
        return None
    room = [n for n in replicas if table.load_of(n.node_id) < n.memory] or replicas
    # ties go at random, as SWARM's balancer breaks them: senders that know nothing yet of a stage
    # would otherwise all start on its lowest-numbered replica
    scored = sorted((arrival_s(view, cost, sender, n, table, home), rng.random(), n.node_id) for n in room)
    cheapest_s, _, pick = scored[0]
    if len(scored) > 1:
        other_s, _, other = scored[rng.randrange(1, len(scored))]
        temperature = table.temperature(cheapest_s)
        if temperature > 0 and rng.random() < math.exp(-(other_s - cheapest_s) / temperature):
            pick = other
    table.sent(pick)
    return pick
