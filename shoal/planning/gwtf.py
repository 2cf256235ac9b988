"""GWTF ("Go With The Flow", Blagoev et al. 2025) flow routing: min-max route cost within capacity.

The paper gives the hop cost and the objective; it publishes neither code nor the local moves, so
the rest is our interpretation, stated here. A *route* is one in-flight slot: a data node, one node
per block stage, back to the data node; a node carries at most `memory` routes. A route's time is
the larger of its summed hop costs and, for each node on it, routes-through-that-node x its compute
(a node serving n routes cannot turn any of them faster than n x c). Routes are built greedily
(cheapest path through nodes with spare capacity, each node's queue counted in, while the estimated
throughput, the sum of 1 / route time, still rises; every data node gets a first route) and refined
by simulated annealing whose every move is decided by one node with what it knows: its own links,
and the load, capacity, compute and carried route costs its candidate next hops advertise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise

from shoal.planning.costs import CostModel
from shoal.planning.plan import Route
from shoal.planning.swarm import NodeId, PlanNode, Swarm


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


@dataclass(frozen=True)
class FlowPlan:
    """Routes (one per in-flight slot) and each route's estimated time in seconds."""

    routes: tuple[Route, ...]
    times_s: tuple[float, ...]

    @property
    def max_time_s(self) -> float:
        return max(self.times_s, default=0.0)

    @property
    def throughput(self) -> float:
        """Estimated microbatches per second: every slot turns over once per route time."""
        return sum(1.0 / t for t in self.times_s if t > 0)

    def routes_of(self, origin: NodeId) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.origin == origin)


def plan_flows(
    swarm: Swarm,
    cost: CostModel,
    rng: random.Random,
    anneal_steps: int = 2000,
    keep: Iterable[Route] = (),
) -> FlowPlan:
    """Greedy routes for every data node, then annealing. `keep` seeds the plan with existing routes
    (only those whose nodes are all still in `swarm`), so a re-plan after churn starts from the last."""
    state = _FlowState(swarm, cost)
    for route in keep:
        if all(h in swarm.by_id for h in (route.origin, *route.hops)) and state.fits(route):
            state.add(route)
    state.fill()
    state.anneal(rng, anneal_steps)
    return state.plan()


class _FlowState:
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

    def time(self, r: int) -> float:
        return self.times[r]

    def _retime(self, routes: set[int]) -> None:
        load, compute = self.load, self.compute
        for r in routes:
            self.times[r] = max(self.path_sum[r], max(load[n] * compute[n] for n in self.routes[r]))

    def _touching(self, nodes) -> set[int]:
        out: set[int] = set()
        for n in nodes:
            out |= self.through[n]
        return out

    def fits(self, route: Route) -> bool:
        if len(route.hops) != self.swarm.stages - 1:
            return False
        nodes = (route.origin, *route.hops)
        return all(self.load[n] < self.swarm.node(n).memory for n in nodes)

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

    def anneal(self, rng: random.Random, steps: int) -> None:
        """Move one hop of one route to another node of the same stage, decided locally.

        The node before the hop weighs the routes it can see change: this route and those its old
        and new next hop carry (their loads change). It accepts a move that lowers the worst of
        them, or a worse one with probability exp(-delta / T) as T cools geometrically.
        """
        if not self.routes or self.swarm.stages < 2 or steps <= 0:
            return
        t0 = 0.05 * max(self.time(r) for r in range(len(self.routes)))
        best = (self._global_objective(), [list(nodes) for nodes in self.routes])
        for step in range(steps):
            temperature = t0 * (1e-3 ** (step / steps))
            if rng.random() < 0.5:
                r = max(range(len(self.times)), key=self.times.__getitem__)
            else:
                r = rng.randrange(len(self.routes))
            pos = rng.randrange(1, self.swarm.stages)
            old = self.routes[r][pos]
            stage_nodes = self.swarm.by_stage[pos]
            options = [n for n in stage_nodes if n.node_id != old and self.load[n.node_id] < n.memory]
            if not options:
                continue
            new = rng.choice(options).node_id
            affected = self.through[old] | self.through[new] | {r}
            before = self._local_objective(affected)
            self._move(r, pos, new)
            delta = self._local_objective(affected) - before
            if delta > 0 and rng.random() >= math.exp(-delta / max(temperature, 1e-12)):
                self._move(r, pos, old)
            elif delta < 0:
                score = self._global_objective()
                if score < best[0]:
                    best = (score, [list(nodes) for nodes in self.routes])
        if self._global_objective() > best[0]:
            self._restore(best[1])

    def _global_objective(self) -> tuple[float, float]:
        """What the plan is judged by (not known to any one node): the worst route, then the mean."""
        return (max(self.times), sum(self.times) / len(self.times))

    def _restore(self, routes: list[list[NodeId]]) -> None:
        for r, nodes in enumerate(routes):
            for pos, node in enumerate(nodes):
                if self.routes[r][pos] != node:
                    self._move(r, pos, node)

    def _local_objective(self, routes: set[int]) -> float:
        times = [self.time(i) for i in routes]
        return max(times) + 0.01 * sum(times) / len(times)

    def _move(self, r: int, pos: int, new: NodeId) -> None:
        old = self.routes[r][pos]
        self.routes[r][pos] = new
        self.load[old] -= 1
        self.through[old].discard(r)
        self.load[new] += 1
        self.through[new].add(r)
        self.path_sum[r] = self.chain_sum(self.routes[r])
        self._retime(self.through[old] | self.through[new] | {r})

    def plan(self) -> FlowPlan:
        routes = tuple(Route(nodes[0], tuple(nodes[1:])) for nodes in self.routes)
        return FlowPlan(routes, tuple(self.times))


def greedy_throughput(swarm: Swarm, cost: CostModel) -> float:
    """Estimated microbatches per second of the greedy routes alone (no annealing: cheap, seedless)."""
    state = _FlowState(swarm, cost)
    state.fill()
    return state.throughput()


def pick_route(
    plan: FlowPlan, origin: NodeId, in_flight: Mapping[tuple[NodeId, tuple[NodeId, ...]], int]
) -> Route | None:
    """The route a data node sends its next microbatch on: the planned route of `origin` with the
    earliest expected finish, (in flight on it + 1) x its time / its planned slots.

    A data node injects whenever its own memory allows (as SWARM's do), so a route may carry more
    than its planned microbatches: the extra ones wait at a full node instead of leaving it idle
    while the next microbatch travels there. `in_flight` is keyed by (origin, hops).
    """
    slots: dict[tuple[NodeId, tuple[NodeId, ...]], list[float]] = {}
    for route, time_s in zip(plan.routes, plan.times_s, strict=True):
        if route.origin == origin:
            slots.setdefault((route.origin, route.hops), []).append(time_s)
    if not slots:
        return None
    key = min(sorted(slots), key=lambda k: (in_flight.get(k, 0) + 1) * max(slots[k]) / len(slots[k]))
    return Route(origin, key[1])
