"""Churn in the simulator: crashes, leaves and joins, and how each lost hop is recovered.

Churn events take block-stage nodes only, unless the churn config asks for data nodes too (see
`churn.py`); scripted faults take whichever node they name. A crash is silent: the node's current
work and everything it holds are gone, and peers learn of it only when a send or an expected reply
times out (`failure_timeout_s`), which is also when it drops out of the view. A leave is announced:
the node leaves the view at once, admits nothing new, bounces activations waiting for its memory,
and goes when it holds nothing. A join takes the stage `join_stage` gives it (planning/policy.py, as
the daemon's router places a joiner once the rules only a live view has, of roles, memory and
seniority, are settled) and serves after `join_warmup_s`. A plan made from the view follows it only
after a re-plan (`knowledge.py`).

Recovery, the same for every policy (DESIGN 4; GWTF; SWARM's public code, whose client keeps a
stage's inputs and, when a backward call fails, sends inputs and output gradient to another replica,
which recomputes that stage's forward and runs its backward): a lost forward hop is re-sent from the
nearest upstream node that still holds the microbatch to a replacement the policy picks; a hop lost
before its backward is recomputed on a replacement from that upstream activation while the
downstream gradient is re-sent, so only the lost hops are redone, and the compute they had done is
counted as wasted. A microbatch restarts from its data node only when the node holding the gradient
to re-send died too. A microbatch whose data node dies is abandoned with that reason; none is ever
dropped without one.
"""

from __future__ import annotations

import random
from dataclasses import replace

from shoal.planning.policy import join_stage
from shoal.sim.churn import ChurnEvent
from shoal.sim.state import ORIGIN, Microbatch, Node


class FaultsMixin:
    """Churn handling for `Simulator` (which provides the state and the event plumbing used here)."""

    # -- the churn process -----------------------------------------------------------------------

    def _schedule_churn(self) -> None:
        event = self.churn.next_event()
        if event is not None:
            self.at(event.time_s, self._on_churn, event)

    def _on_churn(self, event: ChurnEvent) -> None:
        if event.kind == "join":
            self._join(event)
        else:
            victim = self._pick_victim(event.pick)
            if victim is None:
                self.churn_counts["suppressed"] += 1  # it would have emptied a stage (or none may go)
            elif event.kind == "crash":
                self.crash(victim)
            else:
                self.leave(victim)
        self._schedule_churn()

    def _scripted(self, kind: str, node_id: int) -> None:
        if kind == "join":
            self._join(ChurnEvent(self.now, "join", 0.0))
            return
        if kind == "crash-stage":  # the number names a stage: crash its live node with the lowest id
            live = sorted(n.info.node_id for n in self.nodes.values() if n.alive and n.info.stage == node_id)
            if not live:
                return
            kind, node_id = "crash", live[0]
        node = self.nodes[node_id]
        if node.alive and node.accepting:
            (self.crash if kind == "crash" else self.leave)(node)

    def _pick_victim(self, pick: float) -> Node | None:
        """A uniformly drawn live block-stage node (or any live node, if churn takes data nodes too)
        whose stage keeps at least one other live node."""
        serving = [n for n in self.nodes.values() if n.alive and n.accepting]
        per_stage: dict[int, int] = {}
        for n in serving:
            per_stage[n.info.stage] = per_stage.get(n.info.stage, 0) + 1
        takes_data = self.config.churn.data_nodes
        eligible = (n for n in serving if per_stage[n.info.stage] >= 2 and (takes_data or n.info.stage != 0))
        candidates = sorted(eligible, key=lambda n: n.node_id)
        return candidates[int(pick * len(candidates))] if candidates else None

    # -- the three events --------------------------------------------------------------------------

    def crash(self, node: Node) -> None:
        node.alive, node.accepting, node.gone_s = False, False, self.now
        self.churn_counts["crashes"] += 1
        task = node.current
        if task is not None:
            elapsed = self.now - node.started_s
            node.busy_s += elapsed
            self.stats["wasted_s"] += elapsed
            node.current = None
            self.churn_counts["crash_mid_forward" if task.kind == "fwd" else "crash_mid_backward"] += 1
        else:
            self.churn_counts["crash_idle"] += 1
        affected = set(node.resident) | {w[1] for w in node.waiting} | ({task.mb} if task else set())
        # and activations that reached it but are held back until their planned start
        affected |= {mb.mb_id for mb in self.mbs.values() if mb.live and mb.step_node == node.node_id}
        node.waiting.clear()
        node.queue.clear()
        node.resident.clear()
        timeout = self.config.failure_timeout_s
        for mb_id in sorted(affected):
            mb = self.mbs[mb_id]
            if not mb.live:
                continue
            mb.holders.discard(node.node_id)
            if mb.origin == node.node_id:
                self.abandon(mb, "data node crashed")
            elif mb.step_node == node.node_id:
                self.at(self.now + timeout, self.detect, mb, mb.epoch, mb.token)
        for mb_id in self.pending.pop(node.node_id, ()):
            self.abandon(self.mbs[mb_id], "data node crashed")
        self.at(self.now + timeout, self._forget, node.node_id)

    def leave(self, node: Node) -> None:
        node.accepting = False
        self.churn_counts["leaves"] += 1
        self._forget(node.node_id)
        for _, mb_id, epoch, hop, _ in list(node.waiting):
            mb = self.mbs[mb_id]
            if mb.live and mb.epoch == epoch:
                self.stats["bounced"] += 1
                self.at(self.now + self._latency_back(mb, hop), self.detect, mb, epoch, mb.token)
        node.waiting.clear()
        for mb_id in self.pending.pop(node.node_id, ()):
            self.abandon(self.mbs[mb_id], "data node left before injecting it")
        self.maybe_depart(node)

    def _join(self, event: ChurnEvent) -> None:
        if self.spawn is None:
            self.churn_counts["joins_without_template"] += 1
            return
        node_id = self.next_id
        self.next_id += 1
        newcomer = self.spawn(node_id, random.Random(event.pick))
        # a joiner pings the peers it sees listed before it picks a stage (as the daemon does), so a
        # crashed peer whose record has not expired yet does not count as a replica
        answering = self.view.with_nodes(tuple(n for n in self.view.nodes if self.nodes[n.node_id].alive))
        stage = join_stage(self.policy, answering, newcomer)
        self.at(self.now + self.config.join_warmup_s, self._join_ready, replace(newcomer, stage=stage))

    def _join_ready(self, info) -> None:
        self.nodes[info.node_id] = Node(info, born_s=self.now)
        self.churn_counts["joins"] += 1
        self._refresh_view()

    def maybe_depart(self, node: Node) -> None:
        """A leaving node goes once it holds and owes nothing."""
        if node.alive and not node.accepting and not node.resident and node.current is None:
            if not node.queue and not node.waiting and node.sleeping == 0:
                node.alive, node.gone_s = False, self.now
                self.churn_counts["departed"] += 1

    def _forget(self, node_id: int) -> None:
        """Everyone now knows `node_id` is gone: it leaves the planners' view."""
        self.hidden.add(node_id)
        self._refresh_view()

    def _refresh_view(self) -> None:
        serving = tuple(
            n.info for n in sorted(self.nodes.values(), key=lambda n: n.node_id) if n.node_id not in self.hidden
        )
        self.view = self.view.with_nodes(serving)
        self._view_changed()

    # -- recovery ----------------------------------------------------------------------------------

    def detect(self, mb: Microbatch, epoch: int, token: int) -> None:
        """A sender timed out (or was bounced) on the step `mb` waits for."""
        if not mb.live or mb.epoch != epoch or mb.token != token or mb.step is None:
            return
        kind, hop = mb.step
        self.stats["detected_losses"] += 1
        if kind == "fwd" and hop != ORIGIN:
            self._recover_forward(mb, hop)
        elif kind == "bwd" and hop != ORIGIN:
            self._recover_backward(mb, hop)
        else:
            self.abandon(mb, "data node lost")

    def _holder(self, mb: Microbatch, pos: int) -> Node:
        return self.nodes[mb.origin if pos == ORIGIN else mb.route[pos]]

    def _upstream_holder(self, mb: Microbatch, hop: int) -> int:
        """The nearest position below `hop` whose node is alive and still holds the microbatch."""
        for pos in range(hop - 1, -1, -1):
            node = self.nodes[mb.route[pos]]
            if node.alive and mb.mb_id in node.resident:
                return pos
        return ORIGIN

    def _replace(self, mb: Microbatch, first: int, last: int) -> bool:
        """New nodes for positions first..last (their work is lost); False if a stage has nobody left."""
        # what the recovering node knows: the view's departures, and the hops it just found dead
        exclude = self.hidden | {mb.route[p] for p in range(first, last + 1) if mb.route[p] is not None}
        load = self.known_load()  # the replicas' adverts, not their load now
        for pos in range(first, last + 1):
            prev = self._holder(mb, pos - 1)
            after = mb.route[pos + 1] if pos + 1 < len(mb.route) else None
            nxt = self.nodes[after] if after is not None and self.nodes[after].alive else self._holder(mb, ORIGIN)
            stage = mb.stages[pos]
            choice = self.policy.replace(self.view, stage, prev.info, nxt.info, exclude, load)
            if choice is None:
                self.abandon(mb, f"no live node in stage {stage}")
                return False
            lost = mb.work.pop(pos, 0.0)
            if lost > 0:
                self.stats["wasted_s"] += lost
                self.stats["recomputed"] += 1
            mb.route[pos] = choice
            mb.planned.discard(pos)
        return True

    def _recover_forward(self, mb: Microbatch, hop: int) -> None:
        upstream = self._upstream_holder(mb, hop)
        if self._replace(mb, upstream + 1, hop):
            self.send(mb, self._holder(mb, upstream), mb.route[upstream + 1], "fwd", upstream + 1)

    def _recover_backward(self, mb: Microbatch, hop: int) -> None:
        down = self._holder(mb, hop + 1 if hop + 1 < len(mb.route) else ORIGIN)
        if not down.alive:  # the re-sendable gradient died too: start over
            self.restart(mb)
            return
        upstream = self._upstream_holder(mb, hop)
        if not self._replace(mb, upstream + 1, hop):
            return
        target = self.nodes[mb.route[hop]]
        mb.grad_ready_s = self.now + self.cost.transfer_s(self.view, down.info, target.info)
        mb.recompute_until = hop
        self.send(mb, self._holder(mb, upstream), mb.route[upstream + 1], "fwd", upstream + 1)

    def restart(self, mb: Microbatch) -> None:
        """Throw away this attempt and start the microbatch again from its data node."""
        self.stats["restarted"] += 1
        for seconds in mb.work.values():
            self.stats["wasted_s"] += seconds
            self.stats["recomputed"] += 1
        mb.work = {}
        origin = self.nodes[mb.origin]
        for holder in sorted(mb.holders - {mb.origin}):
            self.release(self.nodes[holder], mb)
        mb.epoch += 1
        mb.planned = set()
        mb.recompute_until = None
        if self.policy.hop_by_hop:
            mb.route = [None] * len(mb.route)
        elif any(not (self.nodes[h].alive and self.nodes[h].accepting) for h in mb.route):
            dead = [p for p, h in enumerate(mb.route) if not (self.nodes[h].alive and self.nodes[h].accepting)]
            for pos in dead:
                if not self._replace(mb, pos, pos):
                    return
        self.enqueue(origin, mb, "fwd", ORIGIN)

    def abandon(self, mb: Microbatch, reason: str) -> None:
        """End a microbatch explicitly, with its reason counted."""
        if not mb.live:
            return
        mb.status = "abandoned"
        self.live_count -= 1
        self.abandon_reasons[reason] += 1
        self.stats["wasted_s"] += sum(mb.work.values())
        mb.work = {}
        for holder in sorted(mb.holders):
            self.release(self.nodes[holder], mb)
        self._resolved(mb)
