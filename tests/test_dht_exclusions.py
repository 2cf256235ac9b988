"""The `excluded` list of a node record: bounded, checked, carried into the view and into `shoal status`."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from shoal.dht.records import MAX_EXCLUDED, NodeRecord, load_record, node_info
from shoal.node.cli.status import print_table, summarize
from shoal.planning.swarm_view import SwarmView
from shoal.run_files import load_run_config

RUN = load_run_config("tiny")


def record(**changes) -> dict:
    base = {
        "kind": "node", "run_id": RUN.run_id, "peer_id": "QmData", "maddrs": [], "role": "data", "stage": 0,
        "state": "active", "block_throughput": 3.0, "max_inflight": 8, "inner_step": 4, "outer_epoch": 0,
        "loss": None, "grad_norm": None, "grad_norm_clipped": None, "repair": None, "waiting_for": [], "links": [],
        "replica_distance": None, "averager_maddrs": [], "model_id": None, "reachable": None,
        "relays": [], "relay_service": False, "excluded": [],
        "device": {"kind": "cpu", "name": "test cpu", "total_bytes": 2**34, "free_bytes": 2**33,
                   "planned_bytes": 2**33, "tokens_per_s": 1e5, "compute_dtype": "float32"},
        "placement_note": None, "backup": None, "protocol_version": 5, "started_at": time.time(),
        "updated_at": time.time(),
    }  # fmt: skip
    return {**base, **changes}


def test_exclusions_travel_in_the_record_into_the_view():
    entry = {"peer_id": "QmHostile", "reason": "stage 1: failed 2 audits"}
    parsed = load_record(NodeRecord, record(excluded=[entry]))
    assert node_info(parsed, expires_at=0.0).excluded == (("QmHostile", "stage 1: failed 2 audits"),)


@pytest.mark.parametrize(
    "excluded",
    [
        [{"peer_id": f"QmP{i}", "reason": ""} for i in range(MAX_EXCLUDED + 1)],  # unbounded
        [{"peer_id": "QmP", "reason": "x" * 201}],  # a long reason
        [{"peer_id": "not a peer id!", "reason": ""}],
        [{"peer_id": "QmP"}],
        [{"peer_id": "QmP", "reason": "", "extra": 1}],
        ["QmP"],
    ],
)
def test_malformed_exclusions_are_refused(excluded):
    with pytest.raises(ValueError):
        load_record(NodeRecord, record(excluded=excluded))
    without = record()
    del without["excluded"]
    with pytest.raises(ValueError):
        load_record(NodeRecord, without)


def test_status_shows_who_excluded_whom_and_why(capsys):
    data = node_info(
        load_record(NodeRecord, record(excluded=[{"peer_id": "QmHostile", "reason": "[red]x[/] 2 audits"}])), 0.0
    )
    worker = dataclasses.replace(data, peer_id="QmHonest", role="worker", stage=1, excluded=(("QmHostile", "refused"),))
    hostile = dataclasses.replace(data, peer_id="QmHostile", role="worker", stage=1, excluded=())
    view = SwarmView(RUN.run_id, 3, (0, 2, 2), (data, worker, hostile), time.time())
    doc = summarize(SimpleNamespace(name="tiny", run_id=RUN.run_id, pipeline=SimpleNamespace(stages=3)), view)
    assert doc["excluded"] == [
        {"peer_id": "QmHostile", "by": "QmData", "by_role": "data", "reason": "[red]x[/] 2 audits"},
        {"peer_id": "QmHostile", "by": "QmHonest", "by_role": "worker", "reason": "refused"},
    ]
    assert doc["nodes"][0]["excluded"] == [{"peer_id": "QmHostile", "reason": "[red]x[/] 2 audits"}]
    print_table(doc)
    out = capsys.readouterr().out
    assert "excluded from the routes of" in out and "refused as averaging partner by" in out
    assert "[red]x[/] 2 audits" in out  # a peer's text is printed as it is, never as markup
