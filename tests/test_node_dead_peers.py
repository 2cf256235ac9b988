"""A killed peer's record outlives it (up to its TTL). Real daemons must not believe it: a joiner whose
only listed donor is dead rebuilds the stage from its neighbours instead of starting from random
weights, and a peer killed mid-run leaves every node's choices within about a second."""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

TTL = "30"  # records outlive a killed peer by up to 30 s: everything below happens long before


def _first_logged(log: str, pattern: str) -> float | None:
    """The wall-clock time of the first log line matching `pattern` (logs stamp local time, in ms)."""
    for line in log.splitlines():
        if re.search(pattern, line):
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def test_a_joiner_whose_only_listed_donor_is_dead_repairs_from_the_neighbours(swarm, tmp_path):
    run_file = write_tiny_run(
        tmp_path,
        **{
            "train.steps": 40,
            "pipeline.stages": 4,
            "model.n_layers": 3,
            "averaging.mode": "none",
            "repair.backup_every": 0,
        },  # the rebuild by the rule, which a backup would have spared
    )
    entry = swarm.start_bootstrap("--run-config", str(run_file), "--record-ttl", TTL).maddrs[0]
    common = ("--record-ttl", TTL, "--role", "worker")
    workers = {s: swarm.start_node([entry], *common, "--stage", str(s), wait=False) for s in (1, 2, 3)}
    for worker in workers.values():
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--record-ttl", TTL, "--progress-file", str(progress))

    wait_until(lambda: any(e.get("step", -1) >= 6 for e in progress_events(progress)), 240, "step 6")
    victim = workers[2]
    swarm.kill(victim)  # the only replica of the middle stage; its record stays in the DHT for up to 30 s
    joiner = swarm.start_node([entry], *common, "--stage", "2")
    log = joiner.log()
    lines = [line for line in log.splitlines() if "rebuilt by" in line]
    assert len(lines) == 1, log[-3000:]
    assert f"stage 2 its listed replica(s) ['{victim.peer_id[-8:]}'] gave no weights: rebuilt by checkfree " \
           "from stage(s) [1, 3] (mix " in lines[0], lines[0]  # fmt: skip
    assert "starting from the initialisation" not in log and "fresh" not in log

    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["steps"] == 40 and done["microbatches_abandoned"] == 0, done["abandoned_reasons"]
    assert done["microbatches_completed"] == done["microbatches_injected"]


def test_a_peer_killed_mid_run_leaves_the_routers_and_the_averagers_choices_within_two_seconds(swarm, tmp_path):
    """Two replicas of stage 1 that have averaged once (NoLoCo, H = 4), one of stage 2, a data node.
    One stage-1 replica is SIGKILLed: the data node (its router) and the other replica (its averager)
    each suspect it, which takes it out of their views, within 2 s, while its record lives on."""
    run_file = write_tiny_run(tmp_path, **{"train.steps": 60, "averaging.inner_steps": 4})
    entry = swarm.start_bootstrap("--run-config", str(run_file), "--record-ttl", TTL).maddrs[0]
    common = ("--record-ttl", TTL, "--role", "worker")
    replicas = [swarm.start_node([entry], *common, "--stage", "1", wait=False, name=f"one{i}") for i in range(2)]
    workers = [*replicas, swarm.start_node([entry], *common, "--stage", "2", wait=False)]
    for worker in workers:
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    data = swarm.start_node([entry], "--role", "data", "--record-ttl", TTL, "--progress-file", str(progress))

    wait_until(lambda: any(e.get("step", -1) >= 10 for e in progress_events(progress)), 240, "two outer steps")
    victim, survivor = replicas
    killed_at = time.time()
    swarm.kill(victim)
    short = victim.peer_id[-8:]
    found = {}
    for name, peer in (("router (data node)", data), ("averager (stage-1 replica)", survivor)):
        seen = wait_until(lambda p=peer: _first_logged(p.log(), rf"suspect {short}:"), 30, f"the {name} to suspect")
        found[name] = seen - killed_at
    print("kill -> suspected:", {name: f"{s:.2f} s" for name, s in found.items()})
    assert all(s < 2.0 for s in found.values()), found
    assert time.time() - killed_at < float(TTL)  # its record had not expired

    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0, done["abandoned_reasons"]
