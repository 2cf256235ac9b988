"""The discrete-event core: microbatches move through compute and links in virtual time.

A microbatch starts on its data node (forward of stage 0), visits its route's nodes (forward),
returns to the data node (loss and LM head), retraces the route (backward) and ends with the data
node's backward. A node computes one task at a time and holds at most `memory` microbatches, from
admitting the activation until that microbatch's backward there ends; an activation sent to a full
node waits for room. Without a plan, a node runs backward before forward and otherwise first come,
first served; with a collision-aware plan, it never starts a task before its planned time.

Every choice of where a microbatch goes is asked of the policy (`shoal/planning/policy.py`), with
what a node would know: loads as last advertised and a plan that lags the view (`knowledge.py`).
Churn and recovery live in `faults.py`.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from shoal.planning.costs import CostModel
from shoal.planning.policy import Policy
from shoal.planning.swarm import NodeId, PlanNode, Swarm
from shoal.sim.churn import ChurnConfig, ChurnProcess
from shoal.sim.faults import FaultsMixin
from shoal.sim.knowledge import KnowledgeMixin
from shoal.sim.metrics import SimResult
from shoal.sim.state import ORIGIN, Microbatch, Node, Task

_EPS = 1e-9


@dataclass(frozen=True)
class SimConfig:
    microbatches: int  # a plan's microbatches (static policies) or the N to complete (continuous)
    failure_timeout_s: float = 5.0  # a sender gives up on a silent peer after this long
    join_warmup_s: float = 30.0  # a joining node copies its stage's weights before serving
    jitter: float = 0.0  # sigma of a lognormal factor on every compute time (0: exact)
    heartbeat_s: float = 10.0  # loads are advertised, and views re-read, this often (0: exact and instant)
    replan_s: float = 1.0  # from the heartbeat that sees a view change until the new plan is used
    max_time_s: float = 1e7
    churn: ChurnConfig = ChurnConfig()
    # (time, kind, node) on cue: "crash" or "leave" that node, "crash-stage" the live node of that stage
    # with the lowest id (the number is a stage), "join" a new node from `spawn` (the number is ignored)
    scripted: tuple[tuple[float, str, NodeId], ...] = ()


Spawn = Callable[[NodeId, random.Random], PlanNode]  # a joining node's description (stage ignored)


class Simulator(FaultsMixin, KnowledgeMixin):
    """One run of one policy over one swarm. Build, call `run()` once, read the `SimResult`."""

    def __init__(
        self,
        swarm: Swarm,
        cost: CostModel,
        policy: Policy,
        config: SimConfig,
        rng: random.Random,
        spawn: Spawn | None = None,
    ) -> None:
        self.cost, self.policy, self.config, self.rng = cost, policy, config, rng
        self.spawn = spawn
        self.now = 0.0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.initial = swarm
        self.nodes: dict[NodeId, Node] = {}
        self.view = swarm
        self.hidden: set[NodeId] = set()  # departed nodes the planners have learned about
        self.mbs: dict[int, Microbatch] = {}
        self.pending: dict[NodeId, deque[int]] = {}
        self.continuous = False
        self.stats: Counter[str] = Counter()  # counts, and float seconds under *_s keys
        self.live_count = 0
        self.churn_counts: Counter[str] = Counter()
        self.abandon_reasons: Counter[str] = Counter()
        self.first_injection_s: float | None = None
        self.last_resolution_s = 0.0

    # -- event plumbing --------------------------------------------------------------------------

    def at(self, time_s: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(time_s, self.now), self._seq, fn, args))

    def run(self) -> SimResult:
        view = self.policy.start(self.initial, self.config.microbatches)
        self.view = view
        self.nodes = {n.node_id: Node(n) for n in view.nodes}
        self.next_id = max(self.nodes, default=-1) + 1
        plan = self.policy.plan
        if plan is not None:
            for mb_id, route in enumerate(plan.routes):
                timing = plan.timings[mb_id] if plan.timings else None
                self._create(route.origin, route.hops, timing, status="queued")
                self.pending.setdefault(route.origin, deque()).append(mb_id)
        else:
            self.continuous = True
        churnable = sum(1 for n in view.nodes if n.stage != 0 or self.config.churn.data_nodes)
        self.churn = ChurnProcess(self.config.churn, churnable, random.Random(self.rng.random()))
        self._start_knowledge()
        self._schedule_churn()
        for time_s, kind, node_id in self.config.scripted:
            if kind not in ("crash", "crash-stage", "leave", "join"):
                raise ValueError(f"scripted event {kind!r}: only crash, crash-stage, leave and join can be scripted")
            self.at(time_s, self._scripted, kind, node_id)
        for origin in sorted(n.node_id for n in view.data_nodes):
            self.pump(origin)
        while self._events and not self._done():
            time_s, _, fn, args = heapq.heappop(self._events)
            if time_s > self.config.max_time_s:
                self._abandon_all("time limit")
                break
            self.now = time_s
            fn(*args)
        if not self._done():
            self._abandon_all("stalled: no event could make progress")
        return self._result()

    def _done(self) -> bool:
        if self.live_count:
            return False
        if not self.continuous:
            return True
        if self.stats["completed"] >= self.config.microbatches or not self._can_still_inject():
            return True
        for origin in sorted(n.node_id for n in self.nodes.values() if n.info.stage == 0):
            self.pump(origin)
        if self.live_count == 0:  # live data nodes, but none can start anything: say so and stop
            self.churn_counts["stopped_with_no_route_to_inject"] += 1
            return True
        return False

    def _can_still_inject(self) -> bool:
        return any(n.alive and n.accepting and n.info.stage == 0 for n in self.nodes.values())

    # -- injection -------------------------------------------------------------------------------

    def _create(
        self, origin: NodeId, hops: tuple[NodeId, ...], timing, status: str, injected: tuple[NodeId, ...] | None = None
    ) -> Microbatch:
        """A new microbatch on `hops`; `injected` is the route as the policy handed it out, if other."""
        mb_id = len(self.mbs)
        k = len(hops) if hops or not self.policy.hop_by_hop else self.view.stages - 1
        route: list[NodeId | None] = list(hops) if hops else [None] * k
        stages = [self.view.node(h).stage for h in hops] if hops else list(range(1, k + 1))
        handed_out = tuple(hops) if injected is None else injected
        mb = Microbatch(mb_id, origin, route, stages, timing, handed_out, status=status)
        if timing is not None:
            mb.planned = set(range(ORIGIN, len(hops)))
        self.mbs[mb_id] = mb
        self.stats["injected"] += 1
        self.live_count += 1
        return mb

    def pump(self, origin: NodeId) -> None:
        """Let a data node start what it may: planned microbatches at their release, or new ones."""
        node = self.nodes.get(origin)
        if node is None or not node.alive or not node.accepting:
            return
        while node.has_room:
            if self.continuous:
                if self.stats["completed"] + self.live_count >= self.config.microbatches:
                    return
                planned = self.policy.new_route(origin, self.view)
                if planned is None:
                    return
                hops = self._in_view(origin, planned)
                if hops is None:
                    self.policy.finished(origin, planned)
                    return
                mb = self._create(origin, hops, None, status="active", injected=planned)
            else:
                queue = self.pending.get(origin)
                if not queue:
                    return
                mb = self.mbs[queue[0]]
                if mb.timing is not None and mb.timing.release_s > self.now + _EPS:
                    self.at(mb.timing.release_s, self.pump, origin)
                    return
                queue.popleft()
                mb.status = "active"
            if self.first_injection_s is None:
                self.first_injection_s = self.now
            self._admit(node, mb, ORIGIN, self.now)

    # -- compute ---------------------------------------------------------------------------------

    def _planned_start(self, mb: Microbatch, kind: str, hop: int) -> float:
        t = mb.timing
        if t is None or hop not in mb.planned:
            return 0.0
        if hop == ORIGIN:
            return {"fwd": t.release_s, "head": t.head_s, "bwd": t.origin_backward_s}[kind]
        return t.forward_s[hop] if kind == "fwd" else t.backward_s[hop]

    def enqueue(self, node: Node, mb: Microbatch, kind: str, hop: int, not_before: float = 0.0) -> None:
        mb.step, mb.step_node = (kind, hop), node.node_id
        mb.token += 1
        start = max(not_before, self._planned_start(mb, kind, hop))
        task = Task(mb.mb_id, mb.epoch, kind, hop, self.now, start)
        if start > self.now + _EPS:
            node.sleeping += 1
            self.at(start, self._wake, node, task)
            return
        self._push(node, task)

    def _wake(self, node: Node, task: Task) -> None:
        node.sleeping -= 1
        self.stats["planned_wait_s"] += self.now - task.ready_s
        task.ready_s = self.now
        self._push(node, task)

    def _push(self, node: Node, task: Task) -> None:
        planned = task.not_before > 0
        rank = 0 if planned or task.kind != "fwd" else 1
        key = (rank, task.not_before if planned else task.ready_s)
        self._seq += 1
        heapq.heappush(node.queue, (key, self._seq, task))
        self._try_start(node)

    def _try_start(self, node: Node) -> None:
        while node.alive and node.current is None and node.queue:
            _, _, task = heapq.heappop(node.queue)
            mb = self.mbs[task.mb]
            if not mb.live or mb.epoch != task.epoch:
                continue
            duration = self._duration(node.info, task.kind)
            if self.config.jitter > 0:
                duration *= self.rng.lognormvariate(0.0, self.config.jitter)
            self.stats["collision_s"] += self.now - task.ready_s
            if node.info.stage > 0 and self.now - task.ready_s > _EPS:
                self.stats["collisions"] += 1
            node.current, node.started_s, node.duration_s = task, self.now, duration
            self.at(self.now + duration, self._finish, node, task)

    def _duration(self, info: PlanNode, kind: str) -> float:
        if kind == "fwd":
            return info.forward_s
        return self.cost.head_s(info) if kind == "head" else self.cost.backward_s(info)

    def _finish(self, node: Node, task: Task) -> None:
        if not node.alive or node.current is not task:
            return  # the node crashed while computing; the crash handler accounted for it
        node.current = None
        node.busy_s += node.duration_s
        mb = self.mbs[task.mb]
        if not mb.live or mb.epoch != task.epoch:
            self.stats["wasted_s"] += node.duration_s
        else:
            mb.work[task.hop] = mb.work.get(task.hop, 0.0) + node.duration_s
            self._advance(node, mb, task)
        self._try_start(node)
        self.maybe_depart(node)

    def _advance(self, node: Node, mb: Microbatch, task: Task) -> None:
        """What follows a finished task: the next hop, the loss, or the previous hop's backward."""
        k = len(mb.route)
        if task.kind == "fwd":
            if task.hop != ORIGIN:
                prev = mb.origin if task.hop == 0 else mb.route[task.hop - 1]
                self.policy.observe(prev, node.node_id, mb.stages[task.hop], self.now - mb.sent_s)
            if mb.recompute_until == task.hop:
                mb.recompute_until = None
                self.enqueue(node, mb, "bwd", task.hop, not_before=mb.grad_ready_s)
            elif task.hop + 1 < k:
                nxt = self.choose_hop(mb, task.hop + 1, node.node_id)
                if nxt is not None:
                    self.send(mb, node, nxt, "fwd", task.hop + 1)
            else:
                self.send(mb, node, mb.origin, "head", ORIGIN)
        elif task.kind == "head":
            self.send(mb, node, mb.route[k - 1], "bwd", k - 1)
        else:
            self.release(node, mb)
            if task.hop == ORIGIN:
                self._complete(mb)
            else:
                back = mb.origin if task.hop == 0 else mb.route[task.hop - 1]
                self.send(mb, node, back, "bwd", task.hop - 1)

    def choose_hop(self, mb: Microbatch, pos: int, sender: NodeId) -> NodeId | None:
        if mb.route[pos] is None:
            pick = self.policy.next_hop(sender, mb.stages[pos], self.view, mb.origin)
            if pick is None:
                self.abandon(mb, f"no live node in stage {mb.stages[pos]}")
                return None
            mb.route[pos] = pick
        return mb.route[pos]

    # -- links and memory ------------------------------------------------------------------------

    def send(self, mb: Microbatch, src: Node, dst: NodeId | None, kind: str, hop: int) -> None:
        assert dst is not None, "a route position was never chosen"
        mb.step, mb.step_node = (kind, hop), None
        mb.token += 1
        if kind == "fwd":
            mb.sent_s = self.now
        target = self.nodes[dst].info
        arrive = self.now + self.cost.transfer_s(self.view, src.info, target)
        self.at(arrive, self._arrive, mb, mb.epoch, mb.token, dst, kind, hop, self.now)

    def _arrive(self, mb: Microbatch, epoch: int, token: int, dst: NodeId, kind: str, hop: int, sent: float) -> None:
        if not mb.live or mb.epoch != epoch or mb.token != token:
            return
        node = self.nodes[dst]
        if not node.alive:
            self.at(sent + self.config.failure_timeout_s, self.detect, mb, epoch, token)
            return
        if kind != "fwd":
            if kind == "bwd" and hop + 1 < len(mb.route):
                self.policy.returned(dst, mb.route[hop + 1])
            self.enqueue(node, mb, kind, hop)
            return
        if not node.accepting:
            self.stats["bounced"] += 1
            self.at(self.now + self._latency_back(mb, hop), self.detect, mb, epoch, token)
            return
        self._answer(mb, node, hop)
        mb.step_node = dst
        planned = self._planned_start(mb, "fwd", hop)
        if planned > self.now + _EPS:
            # a planned activation is held outside the node's memory until its planned start
            self.stats["planned_wait_s"] += planned - self.now
            self.at(planned, self._offer, node, mb, epoch, token, hop)
        else:
            self._offer(node, mb, epoch, token, hop)

    def _answer(self, mb: Microbatch, node: Node, hop: int) -> None:
        """The receiver's answer to a forward, as a daemon's Ack carries it: its load, counting this
        microbatch, and its onward cost (GWTF's senders learn their neighbours from these alone)."""
        onward = self.policy.advert(node.node_id, self.view, mb.origin)
        if onward is not None:
            sender = mb.origin if hop == 0 else mb.route[hop - 1]
            self.policy.heard(sender, node.node_id, len(node.resident) + len(node.waiting) + 1, onward, mb.origin)

    def _offer(self, node: Node, mb: Microbatch, epoch: int, token: int, hop: int) -> None:
        """An activation asks for a place in `node`'s memory: admitted now, or queued for one."""
        if not mb.live or mb.epoch != epoch or mb.token != token or not node.alive:
            return  # a crash while it was held back is detected through the crash handler
        if not node.accepting:
            self.stats["bounced"] += 1
            self.at(self.now + self._latency_back(mb, hop), self.detect, mb, epoch, token)
            return
        if node.has_room:
            self._admit(node, mb, hop, self.now)
        else:
            # a plan's admission order is its planned order; otherwise first come, first served
            key = self._planned_start(mb, "fwd", hop) or self.now
            heapq.heappush(node.waiting, (key, mb.mb_id, epoch, hop, self.now))

    def _latency_back(self, mb: Microbatch, hop: int) -> float:
        sender = mb.origin if hop <= 0 else mb.route[hop - 1]
        here = mb.route[hop]
        return self.view.latency(self.nodes[here].info, self.nodes[sender].info)

    def _admit(self, node: Node, mb: Microbatch, hop: int, arrived: float) -> None:
        self.stats["memory_wait_s"] += self.now - arrived
        node.resident.add(mb.mb_id)
        mb.holders.add(node.node_id)
        self.enqueue(node, mb, "fwd", hop)

    def release(self, node: Node, mb: Microbatch) -> None:
        node.resident.discard(mb.mb_id)
        mb.holders.discard(node.node_id)
        while node.waiting and node.has_room and node.alive and node.accepting:
            _, mb_id, epoch, hop, arrived = heapq.heappop(node.waiting)
            other = self.mbs[mb_id]
            if other.live and other.epoch == epoch and other.step_node == node.node_id:
                self._admit(node, other, hop, arrived)
        if node.info.stage == 0:
            self.pump(node.node_id)
        self.maybe_depart(node)

    # -- endings ---------------------------------------------------------------------------------

    def _complete(self, mb: Microbatch) -> None:
        mb.status = "completed"
        self.live_count -= 1
        self.stats["completed"] += 1
        self._resolved(mb)

    def _resolved(self, mb: Microbatch) -> None:
        self.last_resolution_s = self.now
        mb.step, mb.step_node = None, None
        self.policy.finished(mb.origin, mb.injected_route)
        if self.continuous:
            for origin in sorted(n.node_id for n in self.nodes.values() if n.info.stage == 0):
                self.pump(origin)

    def _abandon_all(self, reason: str) -> None:
        for mb in list(self.mbs.values()):
            if mb.live:
                self.abandon(mb, reason)

    # -- the report ------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        start = self.first_injection_s or 0.0
        end = self.last_resolution_s
        makespan = max(0.0, end - start)
        busy = idle = 0.0
        for node in self.nodes.values():
            gone = end if node.gone_s is None else min(node.gone_s, end)
            span = max(0.0, gone - max(node.born_s, start))
            busy += node.busy_s
            idle += max(0.0, span - node.busy_s)
        completed = self.stats["completed"]
        abandoned = sum(self.abandon_reasons.values())
        assert completed + abandoned == self.stats["injected"], "a microbatch ended neither completed nor abandoned"
        plan = self.policy.plan
        return SimResult(
            policy=self.policy.name,
            nodes=len(self.initial.nodes),
            stages=self.initial.stages,
            makespan_s=makespan,
            throughput_mb_per_s=completed / makespan if makespan > 0 else 0.0,
            injected=self.stats["injected"],
            completed=completed,
            abandoned=abandoned,
            abandoned_reasons=dict(self.abandon_reasons),
            recomputed_hops=self.stats["recomputed"],
            restarted=self.stats["restarted"],
            wasted_compute_s=self.stats["wasted_s"],
            busy_s=busy,
            idle_s=idle,
            idle_fraction=idle / (busy + idle) if busy + idle > 0 else 0.0,
            collision_s=self.stats["collision_s"],
            collisions=self.stats["collisions"],
            memory_wait_s=self.stats["memory_wait_s"],
            planned_wait_s=self.stats["planned_wait_s"],
            scheduler_wall_s=self.policy.wall_s,
            predicted_makespan_s=None if plan is None else plan.predicted_makespan_s,
            churn=dict(self.churn_counts),
            scheduler_wall_by_call=dict(self.policy.wall_by_call),
        )
