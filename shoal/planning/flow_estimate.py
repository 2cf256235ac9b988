"""How many microbatches per second a swarm could turn over: greedy min-max routes within capacity.

Not a routing plan (GWTF routes hop by hop, `planning/gwtf.py`): a joining node weighs the stages
with it (`recovery.place_joining_node`), taking the stage where this estimate rises most. A *route*
is one in-flight slot: a data node, one node per block stage, back to the data node; a node carries
at most `memory` routes. A route's time is the larger of its summed GWTF hop costs and, for each node
on it, routes-through-that-node x its compute (a node serving n routes cannot turn any of them faster
than n x c).
"""

from __future__ import annotations

from itertools import pairwise

from shoal.planning.costs import CostModel
from shoal.planning.gwtf import hop_cost
from shoal.planning.plan import Route
from shoal.planning.swarm import NodeId, PlanNode, Swarm


class _GreedyRoutes:
    """Routes under construction, with per-node loads; all cost bookkeeping lives here."""

    def __init__(self, swarm: Swarm, cost: CostModel) -> None:
        self.swarm, self.cost = swarm, cost
        self.routes: list[list[NodeId]] = []  # [origin, hop_1, ..., hop_{S-1}]
        self.load: dict[NodeId, int] = {n.node_id: 0 for n in swarm.nodes}
        self.through: dict[NodeId, set[int]] = {n.node_id: set() for n in swarm.nodes}
        self.path_sum: list[float] = []
        self.times: list[float] = []  # each route's time, kept current as loads change
        self._d: dict[tuple[NodeId, NodeId], float] = {}
        self.compute = {n.node_id: cost.compute_s(n) for n in swarm.nodes}

    def d(self, a: NodeId, b: NodeId) -> float:
        key = (a, b)
        if key not in self._d:
            self._d[key] = hop_cost(self.swarm, self.cost, self.swarm.node(a), self.swarm.node(b))
        return self._d[key]

    def chain_sum(self, nodes: list[NodeId]) -> float:
        chain = nodes + [nodes[0]]
        return sum(self.d(a, b) for a, b in pairwise(chain))

    def _retime(self, routes: set[int]) -> None:
        load, compute = self.load, self.compute
        for r in routes:
            self.times[r] = max(self.path_sum[r], max(load[n] * compute[n] for n in self.routes[r]))

    def _touching(self, nodes) -> set[int]:
        out: set[int] = set()
        for n in nodes:
            out |= self.through[n]
        return out

    def add(self, route: Route) -> None:
        nodes = [route.origin, *route.hops]
        r = len(self.routes)
        self.routes.append(nodes)
        self.path_sum.append(self.chain_sum(nodes))
        self.times.append(0.0)
        for n in nodes:
            self.load[n] += 1
            self.through[n].add(r)
        self._retime(self._touching(nodes))

    def throughput(self) -> float:
        return sum(1.0 / t for t in self.times)

    def cheapest_route(self, origin: PlanNode, over_memory: bool = False) -> Route | None:
        """Layered shortest path from the data node through every block stage and back. A node that
        already carries routes costs its queue on top (routes x compute: a new route waits behind
        them), so that routes spread over a stage's replicas instead of piling onto the one with the
        cheapest links, which leaves the others idle and the next route no faster than the last."""
        best: dict[NodeId, tuple[float, tuple[NodeId, ...]]] = {origin.node_id: (0.0, ())}
        for stage in range(1, self.swarm.stages):
            nxt: dict[NodeId, tuple[float, tuple[NodeId, ...]]] = {}
            for node in self.swarm.by_stage[stage]:
                n = node.node_id
                if self.load[n] >= node.memory and not over_memory:
                    continue
                queue = self.load[n] * self.compute[n]
                options = [(c + self.d(prev, n) + queue, path + (n,)) for prev, (c, path) in best.items()]
                if options:
                    nxt[n] = min(options)
            if not nxt:
                return None
            best = nxt
        c, path = min((c + self.d(last, origin.node_id), path) for last, (c, path) in best.items())
        return Route(origin.node_id, path)

    def fill(self) -> None:
        """Add routes, the least-served data node first, while estimated throughput rises. A data node's
        first route is kept even when it does not raise the estimate: without one it cannot train. So
        is a first route through replicas the other data nodes' routes already fill (a data node that
        joins a busy swarm): its microbatches queue there behind theirs, instead of never starting."""
        blocked: set[NodeId] = set()
        while True:
            data = [n for n in self.swarm.data_nodes if n.node_id not in blocked and self.load[n.node_id] < n.memory]
            if not data:
                return
            origin = min(data, key=lambda n: (self.load[n.node_id], n.node_id))
            route = self.cheapest_route(origin)
            if route is None and self.load[origin.node_id] == 0:
                route = self.cheapest_route(origin, over_memory=True)
            if route is None:
                return  # some stage is full: no data node can add a route
            before = self.throughput()
            self.add(route)
            if self.load[origin.node_id] > 1 and self.throughput() <= before * (1 + 1e-9):
                self.remove_last()
                blocked.add(origin.node_id)

    def remove_last(self) -> None:
        r = len(self.routes) - 1
        nodes = self.routes[r]
        for n in nodes:
            self.load[n] -= 1
            self.through[n].discard(r)
        self.routes.pop()
        self.path_sum.pop()
        self.times.pop()
        self._retime(self._touching(nodes))


def greedy_throughput(swarm: Swarm, cost: CostModel) -> float:
    """Estimated microbatches per second of greedy routes over `swarm` (cheap and seedless)."""
    state = _GreedyRoutes(swarm, cost)
    state.fill()
    return state.throughput()
