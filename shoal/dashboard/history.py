"""What a dashboard learns from successive views of a swarm: events, loss and throughput, the map.

Pure: `History.observe(view)` takes a `SwarmView` (read from the DHT, or made up in a test) and
returns the events it implies; `state()` is the plain data the page draws. Nothing here does I/O
or reads a clock: every time is the DHT time a view or a record carries. Everything kept is
bounded (`max_points`, `max_events`), so a dashboard left open for days uses the same memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from shoal.planning.swarm_view import ROLE_DATA, STATE_ACTIVE, STATE_JOINING, STATE_LEAVING, NodeInfo, SwarmView

MAX_POINTS = 1000
MAX_EVENTS = 200
MAX_GONE = 256  # peers remembered after their record expired, to tell a lapse from a newcomer
# A node re-announces its record every third of its TTL: one older than two thirds missed a round.
STALE_SHARE = 2 / 3


@dataclass(frozen=True)
class Event:
    """Something that changed between two views. Kinds: view (the first one), join, back, restart,
    active, leaving, left, lost, stage, repair, waiting, resumed, excluded, unreachable, uncovered,
    covered."""

    at: float  # DHT time of the view that showed it
    kind: str
    text: str
    peer_id: str | None = None
    stage: int | None = None


@dataclass(frozen=True)
class Sample:
    """One point of a data node's series: its record's time, its inner step, and the value."""

    at: float
    peer_id: str
    step: int
    value: float


def short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


def _stages(stages: tuple[int, ...] | list[int]) -> str:
    return ", ".join(str(s) for s in stages)


def health(node: NodeInfo, now: float) -> str:
    """One word for a replica's card: leaving, joining, waiting (a data node missing a stage),
    unreachable (the peers it asked could not connect to it), stale (its record missed a
    re-announce) or ok."""
    if node.state == STATE_LEAVING:
        return "leaving"
    if node.state == STATE_JOINING:
        return "joining"
    if node.waiting_for:
        return "waiting"
    if node.reachable is False:
        return "unreachable"
    ttl = node.expires_at - node.updated_at
    if ttl > 0 and now - node.updated_at > STALE_SHARE * ttl:
        return "stale"
    return "ok"


def carry_over(old: SwarmView | None, new: SwarmView) -> SwarmView:
    """`new`, plus the nodes of `old` it lacks whose records have not expired yet: a DHT lookup can
    miss a record that is still stored, and a node counts as gone only once its record expires."""
    if old is None:
        return new
    seen = {n.peer_id for n in new.nodes}
    kept = tuple(n for n in old.nodes if n.peer_id not in seen and n.expires_at > new.taken_at)
    if not kept:
        return new
    return replace(new, nodes=tuple(sorted(new.nodes + kept, key=lambda n: (n.stage, n.peer_id))))


def _repair(node: NodeInfo, at: float) -> list[Event]:
    """The repair a node's record announces (CheckFree), as an event; none if it rebuilt nothing."""
    r = node.repair
    if r is None:
        return []
    note = f" ({r.note})" if r.note else ""
    sources = _stages(r.sources) or "nothing"
    text = f"{short(node.peer_id)} rebuilt stage {r.stage} by {r.rule} from stage(s) {sources} in {r.seconds:.2f} s"
    return [Event(at, "repair", text + note, node.peer_id, r.stage)]


def _waiting(node: NodeInfo, at: float) -> list[Event]:
    """The stages a data node's record says it waits for, as an event; none if it waits for nothing."""
    if not node.waiting_for:
        return []
    text = f"data node {short(node.peer_id)} waits for stage(s) {_stages(node.waiting_for)}"
    return [Event(at, "waiting", text, node.peer_id, node.waiting_for[0])]


def _exclusions(node: NodeInfo, at: float, known: tuple[tuple[str, str], ...] = ()) -> list[Event]:
    """The peers a node's record newly says it stopped trusting: a data node's audits took them out
    of its routes, a worker's robust outer step refused them as averaging partners."""
    what = "excluded from the routes of" if node.role == ROLE_DATA else "refused as averaging partner by"
    seen = {peer for peer, _ in known}
    return [
        Event(at, "excluded", f"{short(peer)} {what} {short(node.peer_id)}: {reason}", peer)
        for peer, reason in node.excluded
        if peer not in seen
    ]


def _unreachable(node: NodeInfo, at: float) -> list[Event]:
    """A node whose record says the peers it asked could not connect to it, as an event."""
    if node.reachable is not False:
        return []
    text = f"{short(node.peer_id)} on stage {node.stage} is unreachable: the peers it asked could not connect to it"
    return [Event(at, "unreachable", text, node.peer_id, node.stage)]


def _news(node: NodeInfo, at: float) -> list[Event]:
    """What a record seen for the first time says on its own: a repair, a wait, exclusions, no reach."""
    return _repair(node, at) + _waiting(node, at) + _exclusions(node, at) + _unreachable(node, at)


def _changes(was: NodeInfo, now: NodeInfo, at: float) -> list[Event]:
    """The events between two records of the same peer."""
    peer, who = now.peer_id, short(now.peer_id)
    events = []
    if now.started_at != was.started_at:
        events.append(Event(at, "restart", f"{who} restarted (stage {now.stage})", peer, now.stage))
    if now.stage != was.stage:
        events.append(Event(at, "stage", f"{who} moved from stage {was.stage} to stage {now.stage}", peer, now.stage))
    if now.state != was.state and now.state in (STATE_ACTIVE, STATE_LEAVING):
        kind = "active" if now.state == STATE_ACTIVE else "leaving"
        verb = "is active on" if kind == "active" else "is leaving"
        events.append(Event(at, kind, f"{who} {verb} stage {now.stage}", peer, now.stage))
    if now.repair != was.repair:
        events += _repair(now, at)
    if now.waiting_for != was.waiting_for:
        events += _waiting(now, at)
        if not now.waiting_for:
            events.append(Event(at, "resumed", f"data node {who} no longer waits", peer, now.stage))
    if now.reachable is False and was.reachable is not False:
        events += _unreachable(now, at)
    return events + _exclusions(now, at, was.excluded)


def _coverage(old: SwarmView, new: SwarmView) -> list[Event]:
    """Stages that lost their last live replica, or got one back."""
    events = []
    for s in range(new.stages):
        had, has = bool(old.replicas(s)), bool(new.replicas(s))
        if had and not has:
            events.append(Event(new.taken_at, "uncovered", f"stage {s} has no live replica", stage=s))
        elif has and not had:
            events.append(Event(new.taken_at, "covered", f"stage {s} has a live replica", stage=s))
    return events


def diff_views(old: SwarmView | None, new: SwarmView, gone: Mapping[str, NodeInfo] | None = None) -> list[Event]:
    """The events between two successive views (`old` is None for the first view). `gone` holds the
    last records of peers that were lost or left before: one of them seen again is back (the same
    process, whose record lapsed: a busy or briefly unreachable node) or restarted, not a newcomer."""
    at = new.taken_at
    if old is None:
        replicas = ", ".join(f"{s}:{len(new.replicas(s))}" for s in range(new.stages))
        text = f"first view: {len(new.live_nodes())} live node(s); replicas per stage {replicas}"
        return [Event(at, "view", text), *(e for n in new.nodes for e in _news(n, at))]
    before = {n.peer_id: n for n in old.nodes}
    after = {n.peer_id: n for n in new.nodes}
    gone = gone or {}
    events = []
    for peer, node in after.items():
        if peer in before:
            events += _changes(before[peer], node, at)
        elif peer in gone:
            if gone[peer].started_at == node.started_at:
                text = f"{short(peer)} is back on stage {node.stage}: its record had lapsed"
                events.append(Event(at, "back", text, peer, node.stage))
            events += _changes(gone[peer], node, at)
        else:
            text = f"{short(peer)} joined stage {node.stage} as {node.role} ({node.state})"
            events += [Event(at, "join", text, peer, node.stage), *_news(node, at)]
    for peer, was in before.items():
        if peer in after:
            continue
        if was.state == STATE_LEAVING:
            events.append(Event(at, "left", f"{short(peer)} left stage {was.stage}", peer, was.stage))
        else:
            text = f"{short(peer)} lost from stage {was.stage}: its record expired (crashed or unreachable)"
            events.append(Event(at, "lost", text, peer, was.stage))
    return events + _coverage(old, new)


def node_card(node: NodeInfo, view: SwarmView) -> dict[str, Any]:
    """A replica as the map shows it."""
    blocks = max(1, view.blocks_per_stage[node.stage]) if node.stage < view.stages else 1
    return {
        "peer_id": node.peer_id,
        "role": node.role,
        "state": node.state,
        "health": health(node, view.taken_at),
        "inner_step": node.inner_step,
        "outer_epoch": node.outer_epoch,
        "loss": node.loss,
        "throughput": node.block_throughput / blocks,  # microbatches per second it can serve
        "age_s": max(0.0, view.taken_at - node.updated_at),
        "waiting_for": list(node.waiting_for),
        "reachable": node.reachable,
        "excluded": [{"peer_id": peer, "reason": reason} for peer, reason in node.excluded],
        "repair": None if node.repair is None else asdict(node.repair),
    }


def swarm_map(view: SwarmView) -> list[dict[str, Any]]:
    """Stages × replicas: every stage of the run, with the cards of the nodes that hold it."""
    return [
        {
            "stage": s,
            "blocks": view.blocks_per_stage[s],
            "live": len(view.replicas(s)),
            "capacity": view.stage_throughput(s) if s else None,
            "replicas": [node_card(n, view) for n in view.nodes if n.stage == s],
        }
        for s in range(view.stages)
    ]


class History:
    """The dashboard's memory: the last view (with unexpired nodes carried over), recent events, and
    each data node's loss and throughput (tokens per second from its inner-step progress)."""

    def __init__(self, tokens_per_step: int, max_points: int = MAX_POINTS, max_events: int = MAX_EVENTS):
        self.tokens_per_step = tokens_per_step
        self.view: SwarmView | None = None
        self.views = 0
        self.events: deque[Event] = deque(maxlen=max_events)
        self.loss: deque[Sample] = deque(maxlen=max_points)
        self.throughput: deque[Sample] = deque(maxlen=max_points)
        self._last: dict[str, NodeInfo] = {}  # each data node's record at the step last sampled
        self.gone: dict[str, NodeInfo] = {}  # the last record of peers lost or left, oldest first

    def observe(self, view: SwarmView) -> list[Event]:
        """Take a new view; returns the events it brought."""
        merged = carry_over(self.view, view)
        events = diff_views(self.view, merged, self.gone)
        self.events.extend(events)
        self._remember_gone(merged)
        self._sample(merged)
        self.view = merged
        self.views += 1
        return events

    def _remember_gone(self, view: SwarmView) -> None:
        present = {n.peer_id for n in view.nodes}
        for peer in present:
            self.gone.pop(peer, None)
        for n in self.view.nodes if self.view is not None else ():
            if n.peer_id not in present:
                self.gone[n.peer_id] = n
        for peer in list(self.gone)[: max(0, len(self.gone) - MAX_GONE)]:
            del self.gone[peer]

    def _sample(self, view: SwarmView) -> None:
        data_nodes = [n for n in view.nodes if n.role == ROLE_DATA]
        self._last = {peer: n for peer, n in self._last.items() if any(d.peer_id == peer for d in data_nodes)}
        for node in data_nodes:
            last = self._last.get(node.peer_id)
            fresh = last is None or last.started_at != node.started_at or node.inner_step < last.inner_step
            if not fresh and node.inner_step == last.inner_step:
                continue  # the same step announced again
            if node.loss is not None:
                self.loss.append(Sample(node.updated_at, node.peer_id, node.inner_step, node.loss))
            if not fresh and node.updated_at > last.updated_at:
                steps = node.inner_step - last.inner_step
                rate = steps * self.tokens_per_step / (node.updated_at - last.updated_at)
                self.throughput.append(Sample(node.updated_at, node.peer_id, node.inner_step, rate))
            self._last[node.peer_id] = node

    def state(self) -> dict[str, Any]:
        """Plain data for the page: the map, the series (oldest first), the events (newest first)."""
        return {
            "views": self.views,
            "taken_at": None if self.view is None else self.view.taken_at,
            "stages": [] if self.view is None else swarm_map(self.view),
            "loss": [asdict(s) for s in self.loss],
            "throughput": [asdict(s) for s in self.throughput],
            "events": [asdict(e) for e in reversed(self.events)],
        }
