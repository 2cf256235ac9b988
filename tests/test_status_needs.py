"""`shoal status` says which stages have no live replica and how many nodes the run needs (pure, no processes)."""

from __future__ import annotations

from types import SimpleNamespace

from shoal.node.cli.status import summarize, swarm_needs
from shoal.planning.swarm_view import NodeInfo, SwarmView


def _node(peer: str, stage: int, state: str = "active") -> NodeInfo:
    return NodeInfo(
        peer_id=peer,
        role="data" if stage == 0 else "worker",
        stage=stage,
        state=state,
        block_throughput=10.0,
        max_inflight=8,
    )


def _view(*nodes: NodeInfo, stages: int = 3) -> SwarmView:
    return SwarmView("run", stages, (0,) + (2,) * (stages - 1), tuple(nodes))


def test_an_empty_swarm_needs_a_node_per_stage():
    needs = swarm_needs(_view())
    assert not needs["ready"]
    assert needs["nodes_required"] == 3
    assert needs["live_nodes"] == 0
    assert needs["stages_without_replica"] == [0, 1, 2]
    assert needs["nodes_to_start"] == 3
    assert needs["message"] == (
        "stages 0, 1 and 2 have no live replica: start 3 more nodes "
        "(this run needs at least 3: one data node and one worker per block stage)"
    )


def test_a_missing_middle_stage_is_named():
    # the README walk-through with one node too few: a data node and one worker
    needs = swarm_needs(_view(_node("d", 0), _node("w", 2), stages=3))
    assert not needs["ready"]
    assert needs["stages_without_replica"] == [1]
    assert needs["nodes_to_start"] == 1
    assert needs["message"] == (
        "stage 1 has no live replica: start 1 more node "
        "(this run needs at least 3: one data node and one worker per block stage)"
    )


def test_every_stage_covered_is_ready():
    view = _view(_node("d", 0), _node("a", 1), _node("b", 1), _node("c", 2), _node("j", 3, "joining"), stages=4)
    needs = swarm_needs(view)
    assert needs["ready"]
    assert needs["stages_without_replica"] == []
    assert needs["nodes_to_start"] == 0
    assert needs["live_nodes"] == 5
    assert needs["message"] == "ready: every stage has a live replica"


def test_a_leaving_node_does_not_count():
    view = _view(_node("d", 0), _node("a", 1), _node("b", 2, "leaving"))
    needs = swarm_needs(view)
    assert not needs["ready"]
    assert needs["live_nodes"] == 2
    assert needs["stages_without_replica"] == [2]
    assert needs["message"].startswith("stage 2 has no live replica: start 1 more node")


def test_the_status_document_carries_the_needs():
    run = SimpleNamespace(name="tiny", run_id="abc", pipeline=SimpleNamespace(stages=3))
    view = _view(_node("d", 0), _node("a", 1))
    doc = summarize(run, view)
    assert doc["needs"] == swarm_needs(view)
    assert doc["needs"]["stages_without_replica"] == [2]
