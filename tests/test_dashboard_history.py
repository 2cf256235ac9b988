"""The dashboard's memory: events from successive views, bounded series, the map (no network)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shoal.dashboard.history import History, carry_over, diff_views, health
from shoal.planning.swarm_view import NodeInfo, RepairNote, SwarmView

TTL = 30.0
DATA, W1, W2, W3 = (f"QmPeerIdPrefix{tag}" for tag in ("dataNode", "worker01", "worker02", "worker03"))


def node(peer: str, stage: int, at: float, **fields) -> NodeInfo:
    """A record announced at `at` that lives TTL seconds."""
    role = "data" if stage == 0 else "worker"
    base = dict(state="active", block_throughput=8.0, max_inflight=4, started_at=1.0, updated_at=at)
    return NodeInfo(peer, role, stage, **(base | {"expires_at": at + TTL} | fields))


def view(at: float, *nodes: NodeInfo) -> SwarmView:
    return SwarmView("run", 3, (0, 2, 2), tuple(sorted(nodes, key=lambda n: (n.stage, n.peer_id))), taken_at=at)


def kinds(events) -> list[tuple[str, str | None]]:
    return [(e.kind, e.peer_id) for e in events]


def test_the_first_view_is_one_summary_event():
    events = diff_views(None, view(100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0)))
    assert kinds(events) == [("view", None)]
    assert events[0].text == "first view: 2 live node(s); replicas per stage 0:1, 1:1, 2:0"


def test_joins_activations_moves_and_restarts():
    old = view(100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0, state="joining"))
    new = view(
        103.0,
        node(DATA, 0, 102.0, started_at=50.0),  # a new process under the same peer id
        node(W1, 2, 102.0),  # moved and went active
        node(W2, 1, 102.0, state="joining"),
    )
    events = diff_views(old, new)
    assert kinds(events) == [
        ("restart", DATA),
        ("join", W2),
        ("stage", W1),
        ("active", W1),
        ("covered", None),  # stage 2 got its first replica
    ]
    assert events[1].text == "…worker02 joined stage 1 as worker (joining)"
    assert events[2].text == "…worker01 moved from stage 1 to stage 2"
    assert events[4].stage == 2 and events[4].at == 103.0


def test_a_crashed_node_stays_until_its_record_expires_then_is_lost():
    history = History(tokens_per_step=256)
    history.observe(view(100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0), node(W2, 2, 99.0)))
    # W2 is missing from a read while its record still lives: a missed lookup, not a departure
    assert history.observe(view(122.0, node(DATA, 0, 121.0), node(W1, 1, 121.0))) == []
    assert W2 in {n.peer_id for n in history.view.nodes}
    (stage2,) = [s for s in history.state()["stages"] if s["stage"] == 2]
    assert [c["health"] for c in stage2["replicas"]] == ["stale"]  # 23 s old: it missed a re-announce
    events = history.observe(view(130.0, node(DATA, 0, 129.0), node(W1, 1, 129.0)))
    assert kinds(events) == [("lost", W2), ("uncovered", None)]
    assert events[0].text == "…worker02 lost from stage 2: its record expired (crashed or unreachable)"
    assert events[1].text == "stage 2 has no live replica"


def test_a_node_that_announces_leaving_then_goes_has_left():
    first = view(100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0))
    leaving = view(103.0, node(DATA, 0, 102.0), node(W1, 1, 102.0, state="leaving"))
    gone = view(140.0, node(DATA, 0, 139.0))
    assert kinds(diff_views(first, leaving)) == [("leaving", W1), ("uncovered", None)]
    assert kinds(diff_views(leaving, carry_over(leaving, gone))) == [("left", W1)]


def test_a_peer_seen_again_after_its_record_lapsed_is_back_or_restarted_not_new():
    history = History(tokens_per_step=1)
    history.observe(view(100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0, state="joining", expires_at=105.0)))
    assert kinds(history.observe(view(106.0, node(DATA, 0, 105.0)))) == [("lost", W1), ("uncovered", None)]
    events = history.observe(view(108.0, node(DATA, 0, 107.0), node(W1, 1, 107.0)))  # busy starting, now active
    assert kinds(events) == [("back", W1), ("active", W1), ("covered", None)]
    assert events[0].text == "…worker01 is back on stage 1: its record had lapsed"
    history.observe(view(140.0, node(DATA, 0, 139.0)))  # crashed
    events = history.observe(view(150.0, node(DATA, 0, 149.0), node(W1, 2, 149.0, started_at=145.0)))
    assert kinds(events) == [("restart", W1), ("stage", W1), ("covered", None)]
    assert W1 not in history.gone


def test_a_repair_and_a_wait_are_told_once():
    repair = RepairNote(stage=2, rule="checkfree", sources=(1,), inner_step=40, seconds=0.25, at=120.0, note="edge")
    waiting = view(100.0, node(DATA, 0, 99.0, waiting_for=(2,)), node(W1, 1, 99.0))
    rebuilt = node(W3, 2, 120.0, repair=repair)
    repaired = view(121.0, node(DATA, 0, 120.0, waiting_for=(2,)), node(W1, 1, 120.0), rebuilt)
    again = view(124.0, node(DATA, 0, 123.0), node(W1, 1, 123.0), node(W3, 2, 123.0, repair=repair))
    history = History(tokens_per_step=256)
    assert kinds(history.observe(waiting)) == [("view", None), ("waiting", DATA)]
    events = history.observe(repaired)
    assert kinds(events) == [("join", W3), ("repair", W3), ("covered", None)]
    assert events[1].text == "…worker03 rebuilt stage 2 by checkfree from stage(s) 1 in 0.25 s (edge)"
    assert kinds(history.observe(again)) == [("resumed", DATA)]
    assert kinds(history.observe(replace(again, taken_at=127.0))) == []


def test_exclusions_and_unreachable_nodes_are_told_once():
    audit = (W1, "audit: blamed in 2 of 3 audits")
    first = view(
        100.0, node(DATA, 0, 99.0), node(W1, 1, 99.0), node(W2, 1, 99.0, excluded=((W1, "far from the mean"),))
    )
    history = History(tokens_per_step=1)
    events = history.observe(first)
    assert kinds(events) == [("view", None), ("excluded", W1)]
    assert events[1].text == "…worker01 refused as averaging partner by …worker02: far from the mean"
    later = replace(first, taken_at=103.0, nodes=(node(DATA, 0, 102.0, excluded=(audit,)), *first.nodes[1:]))
    events = history.observe(later)
    assert kinds(events) == [("excluded", W1)]
    assert events[0].text == "…worker01 excluded from the routes of …dataNode: audit: blamed in 2 of 3 audits"
    assert history.observe(replace(later, taken_at=106.0)) == []
    unreachable = replace(later, taken_at=109.0, nodes=(*later.nodes[:2], node(W2, 1, 108.0, reachable=False)))
    assert kinds(history.observe(unreachable)) == [("unreachable", W2)]
    (stage1,) = [s for s in history.state()["stages"] if s["stage"] == 1]
    assert [c["health"] for c in stage1["replicas"]] == ["ok", "unreachable"]
    assert stage1["replicas"][1]["excluded"] == []  # its newest record no longer lists W1


def test_loss_and_throughput_follow_the_data_nodes_steps():
    history = History(tokens_per_step=100)
    history.observe(view(100.0, node(DATA, 0, 100.0, inner_step=0)))
    history.observe(view(102.0, node(DATA, 0, 101.0, inner_step=2, loss=6.0)))
    history.observe(view(104.0, node(DATA, 0, 101.0, inner_step=2, loss=6.0)))  # the same record again
    history.observe(view(106.0, node(DATA, 0, 105.0, inner_step=10, loss=5.5)))
    doc = history.state()
    assert [(p["at"], p["step"], p["value"]) for p in doc["loss"]] == [(101.0, 2, 6.0), (105.0, 10, 5.5)]
    # 2 steps in 1 s, then 8 steps in 4 s, of 100 tokens each
    assert [(p["step"], p["value"]) for p in doc["throughput"]] == [(2, 200.0), (10, 200.0)]
    # a restart is a fresh start: its first record is a loss point, not a rate across two processes
    history.observe(view(110.0, node(DATA, 0, 109.0, inner_step=3, loss=5.4, started_at=108.0)))
    assert len(history.state()["loss"]) == 3 and len(history.state()["throughput"]) == 2


def test_memory_is_bounded():
    history = History(tokens_per_step=1, max_points=5, max_events=4)
    for i in range(50):
        at = 100.0 + i
        flapping = [node(W1, 1, at, expires_at=at + 0.5)] if i % 2 else []  # joins, then is lost
        peers = [node(DATA, 0, at, inner_step=i, loss=1.0 + i), *flapping]
        history.observe(view(at, *peers))
    doc = history.state()
    assert len(doc["loss"]) == 5 and len(doc["throughput"]) == 5 and len(doc["events"]) == 4
    assert doc["loss"][-1]["value"] == 50.0 and doc["events"][0]["at"] == 149.0  # newest kept, newest first


def test_state_is_plain_json_with_every_stage_on_the_map():
    history = History(tokens_per_step=1)
    assert history.state()["stages"] == [] and history.state()["taken_at"] is None
    history.observe(view(100.0, node(DATA, 0, 99.0, loss=7.25, waiting_for=(2,)), node(W1, 1, 99.0)))
    doc = json.loads(json.dumps(history.state()))
    assert [(s["stage"], s["live"], len(s["replicas"])) for s in doc["stages"]] == [(0, 1, 1), (1, 1, 1), (2, 0, 0)]
    (data,) = doc["stages"][0]["replicas"]
    assert data["peer_id"] == DATA and data["loss"] == 7.25 and data["health"] == "waiting"
    assert data["age_s"] == 1.0
    assert doc["stages"][1]["capacity"] == pytest.approx(4.0)  # 8 blocks/s over 2 blocks
    assert doc["stages"][1]["replicas"][0]["throughput"] == pytest.approx(4.0)


def test_health_words():
    assert health(node(W1, 1, 100.0), 110.0) == "ok"
    assert health(node(W1, 1, 100.0), 121.0) == "stale"  # missed a re-announce (every TTL/3)
    assert health(node(W1, 1, 100.0, state="joining"), 101.0) == "joining"
    assert health(node(W1, 1, 100.0, state="leaving"), 101.0) == "leaving"
    assert health(node(DATA, 0, 100.0, waiting_for=(1,)), 101.0) == "waiting"
    assert health(node(W1, 1, 100.0, reachable=False), 101.0) == "unreachable"
