"""What a node knows, and when: load as last advertised, and re-plans that take time.

The daemon re-announces its record and reads a fresh view once per heartbeat (`NodeConfig.heartbeat_s`:
a third of the record's 30 s lifetime, so 10 s), and a data node re-plans over the view it just read.
No node sees another's load as it is now, and no plan changes the instant the swarm does. The
simulator keeps to that:

- **Load as advertised.** At every heartbeat tick (every `heartbeat_s` of virtual time from the
  start, all nodes in step) each node advertises how many microbatches it holds or has waiting for
  its memory. Whoever weighs replicas by the DHT's adverts (the replacement of a lost hop, the
  capacity baseline) sees those adverts, up to one heartbeat old; before the
  first tick, what every node advertised on joining: nothing held.
- **Answers.** GWTF's senders route on what each receiver answered when it took their last forward
  (its load then and its onward cost, `Simulator._answer`), as a daemon's Ack carries them.
- **Re-plans take time.** When the view changes (a departure detected or announced, a joiner
  ready), a policy's state (GWTF's neighbour tables warm up again; most policies keep none) follows the view
  as it stood at the next heartbeat tick, and comes into force `replan_s` later. Until then the data
  nodes keep injecting along the old plan; a planned hop through a node the view has lost is
  replaced, when its microbatch is injected, by the policy's replacement rule, as the daemon's
  router does. A change that lands while a re-plan runs is taken up at the first tick after it ends.

`replan_s` is a stated constant, not the planner's measured wall time, so that a seed gives the same
run on any machine: 1 s covers reading the view and pinging its peers (the daemon does both before
it re-plans) and any re-planning.

What stays shared knowledge: the membership of the view (who serves which stage, how fast, with how
much memory, and the links), which every node reads from the DHT records. Every policy sees a
departure when the first sender times out on it (or when it is announced) and a joiner when it is
ready, including SWARM's balancers, whose public code re-reads the DHT only every 30 s: in that
respect the model errs in SWARM's favour. `heartbeat_s = 0` gives the omniscient model: every load
exact and a re-plan started the moment the view changes.
"""

from __future__ import annotations

from shoal.planning.swarm import NodeId, Swarm


class KnowledgeMixin:
    """Adverts and re-plans for `Simulator` (which provides the state and the event plumbing used here)."""

    def _start_knowledge(self) -> None:
        self.adverts: dict[NodeId, int] = {}  # the load each node advertised at the last heartbeat
        self.view_version = 0  # bumped whenever the view changes
        self.planned_version = 0  # the view version the policy's plan was made from
        self.replanning = False
        if self.config.heartbeat_s > 0:
            self.at(self.config.heartbeat_s, self._heartbeat)

    def _load_now(self) -> dict[NodeId, int]:
        return {n.node_id: len(n.resident) + len(n.waiting) for n in self.nodes.values()}

    def known_load(self) -> dict[NodeId, int]:
        """The load a deciding node knows of: the last adverts (exact only with `heartbeat_s = 0`)."""
        return self._load_now() if self.config.heartbeat_s <= 0 else self.adverts

    def _heartbeat(self) -> None:
        self.adverts = self._load_now()
        self._maybe_replan()
        if self._events:  # tick only while something else can still happen, so a stalled run still ends
            self.at(self.now + self.config.heartbeat_s, self._heartbeat)

    def _view_changed(self) -> None:
        """The view changed; the plan follows at the next heartbeat plus `replan_s`."""
        self.view_version += 1
        if self.config.heartbeat_s <= 0:
            self._maybe_replan()

    def _maybe_replan(self) -> None:
        if self.replanning or self.planned_version == self.view_version:
            return
        if self.config.replan_s <= 0:
            self._install_plan(self.view, self.view_version)
            return
        self.replanning = True
        self.at(self.now + self.config.replan_s, self._install_plan, self.view, self.view_version)

    def _install_plan(self, view: Swarm, version: int) -> None:
        """The re-plan started over `view` is done: from now on data nodes inject along it."""
        self.replanning = False
        self.policy.view_changed(view)
        self.planned_version = version
        if self.config.heartbeat_s <= 0 and self.config.replan_s <= 0:
            return  # the omniscient model: re-planned inside the event that changed the view
        if self.config.heartbeat_s <= 0:
            self._maybe_replan()
        for origin in sorted(n.node_id for n in self.nodes.values() if n.info.stage == 0):
            self.pump(origin)  # a data node the old plan left without a route may have one now

    def _in_view(self, origin: NodeId, planned: tuple[NodeId, ...]) -> tuple[NodeId, ...] | None:
        """`planned`, with every hop through a node the view has lost replaced by the policy's rule
        (a plan made before the loss); None if some stage has nobody left to take it."""
        members = self.view.by_id
        if all(h in members for h in planned):
            return planned
        hops = list(planned)
        load = self.known_load()
        for pos, node_id in enumerate(hops):
            if node_id in members:
                continue
            prev = self.nodes[origin if pos == 0 else hops[pos - 1]].info
            after = hops[pos + 1] if pos + 1 < len(hops) and hops[pos + 1] in members else origin
            stage = self.nodes[node_id].info.stage
            choice = self.policy.replace(self.view, stage, prev, self.nodes[after].info, self.hidden, load)
            if choice is None:
                return None
            hops[pos] = choice
        return tuple(hops)
