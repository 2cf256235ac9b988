"""SkipPipe paths on real daemons: a data node sends each training microbatch through a planned
share of the block stages (evaluation always runs the whole model), and the model still learns."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def test_a_data_node_follows_skippipe_partial_paths(swarm, tmp_path):
    steps = 10
    run_file = write_tiny_run(tmp_path, **{"train.steps": steps, "pipeline.stages": 5, "averaging.mode": "none"})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = [tmp_path / f"stage{s}.json" for s in range(1, 5)]
    workers = [
        swarm.start_node([entry], "--role", "worker", "--stage", str(s), "--stats-file", str(stats[s - 1]), wait=False)
        for s in range(1, 5)
    ]
    for worker in workers:
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--paths", "skippipe", "--skip", "0.25", "--progress-file",
                     str(progress))  # fmt: skip
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    for worker in workers:
        assert swarm.stop(worker) == 0
    forwards = [json.loads(p.read_text())["engine"]["forwards"] for p in stats]
    skipping, evaluation = (steps - 1) * 4, 2 * 4  # microbatches: 4 per step; 2 validation batches of 4
    # a training path visits 3 of the 4 block stages, but the 10th step is SkipPipe's full pass
    assert sum(forwards) == 3 * skipping + 4 * (4 + evaluation)
    assert max(forwards) - min(forwards) <= 2  # and every stage sees the same share
    events = [e for e in progress_events(progress) if e["event"] == "step"]
    assert [e["full_pass"] for e in events] == [False] * 9 + [True]
    assert all(e["plan"] for e in events[:9])  # each skipping step followed the shared timetable
    losses = [e["loss"] for e in events]
    assert losses[-1] < losses[0]
