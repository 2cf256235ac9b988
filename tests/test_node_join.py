"""Joins that neither stall nor strand: joiners that come together copy their stage from different
donors, and a node nobody can dial back takes the data role, which needs no inbound connection,
and trains.

Run: .venv/bin/python -m pytest tests/test_node_join.py -q
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def _copied_from(log: str) -> str:
    found = re.search(r"copied stage \d+ from (\S+) \(inner step", log)
    assert found, log[-3000:]
    return found.group(1)


def test_two_joiners_at_once_copy_from_different_donors(swarm, tmp_path):
    # no stage backups: stage 2's refreshes of its backup of stage 1 take a donor's one copy slot too,
    # and with copies held 10 s a joiner turned away by both donors copies the other joiner instead
    run_file = write_tiny_run(tmp_path, **{"train.steps": 400, "repair.backup_every": 0})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    # each copy holds its donor 10 s (as a slow uplink would), so the two copies overlap even when the
    # joiners' start-ups, on two loaded cores, end seconds apart: a donor serves one at a time, and the
    # joiner it turns away takes the other donor
    slow = ("--inject-copy-delay", "10")
    donors = [swarm.start_node([entry], "--stage", "1", *slow, name=f"donor{i}") for i in range(2)]
    swarm.start_node([entry], "--stage", "2", name="stage2")
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), name="data")
    steps = lambda: sum(e["event"] == "step" for e in progress_events(progress))  # noqa: E731
    wait_until(lambda: steps() >= 3, 120, "a few training steps")

    joiners = [swarm.start_node([entry], "--stage", "1", wait=False, name=f"joiner{i}") for i in range(2)]
    for joiner in joiners:
        swarm.wait_ready(joiner)
    sources = [_copied_from(j.log()) for j in joiners]
    assert sorted(sources) == sorted(d.peer_id[-8:] for d in donors), sources  # one copy per donor


def test_an_unreachable_node_takes_the_data_role_and_trains(swarm, tmp_path):
    # averaging off: GWTF routing, whose plan once left a second data node no route at all
    run_file = write_tiny_run(tmp_path, **{"train.steps": 6, "averaging.mode": "none"})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    for stage in (1, 2):
        swarm.start_node([entry], "--stage", str(stage))
    swarm.start_node([entry], "--role", "data", "--progress-file", str(tmp_path / "first.jsonl"))
    # the swarm has its data node: a reachable newcomer would take a block stage
    progress = tmp_path / "progress.jsonl"
    unreachable = swarm.start_node([entry], "--inject-unreachable", "--progress-file", str(progress))
    assert unreachable.stage == 0
    log = unreachable.log()
    assert "not reachable: taking the data role, which dials every peer itself" in log, log[-3000:]
    done = wait_until(lambda: done_event(progress), 180, "the unreachable data node to train")
    assert done["microbatches_abandoned"] == 0 and done["microbatches_completed"] == done["microbatches_injected"]

    # told to be a stage worker, it refuses in one line: peers would have to dial it
    worker = swarm.start_node([entry], "--inject-unreachable", "--role", "worker", wait=False)
    worker.process.wait(timeout=120)
    log = worker.log()
    assert worker.process.returncode == 2 and "Traceback" not in log, log[-2000:]
    assert "a stage worker must be dialed by its peers" in log
