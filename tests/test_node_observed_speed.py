"""A replica that claims more speed than it has: the data node's trips show it, and routing stops
believing the claim. Both replicas of the one block stage report the same measured throughput; one
is made 0.4 s slower per forward (fault injection). Capacity routing, which splits a step's
microbatches by claimed speed and load, would send it half of them; routed by observed speed, it
gets few once the first trips through it come home."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import done_event, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_a_replica_slower_than_it_claims_is_routed_as_slow_as_it_is(swarm, tmp_path):
    steps = 16
    run_file = write_tiny_run(tmp_path, **{"train.steps": steps, "pipeline.stages": 2, "averaging.mode": "none"})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = {name: tmp_path / f"{name}.json" for name in ("honest", "slow")}
    delays = {"honest": "0", "slow": "0.4"}
    workers = {
        name: swarm.start_node([entry], "--role", "worker", "--stage", "1", "--record-ttl", "6", "--stats-file",
                               str(stats[name]), "--inject-forward-delay", delays[name], wait=False, name=name)
        for name in stats
    }  # fmt: skip
    for worker in workers.values():
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--routing", "capacity", "--record-ttl", "6",
                     "--progress-file", str(progress))  # fmt: skip
    done = wait_until(lambda: done_event(progress), 240, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    for worker in workers.values():
        assert swarm.stop(worker) == 0
    forwards = {name: json.loads(path.read_text())["engine"]["forwards"] for name, path in stats.items()}
    print("forwards per replica:", forwards)
    assert forwards["honest"] + forwards["slow"] >= steps * 4 + 2 * 4  # every microbatch and evaluation (+ resends)
    assert forwards["slow"] * 3 <= forwards["honest"]  # claims alone would split them evenly
