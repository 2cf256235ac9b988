"""CheckFree+ for stage 0 over real daemons: under `repair.rule = "checkfree_plus"` the workers of
stage 0's neighbours keep a copy of it (shoal/node/stage/edge_copy.py), and a data node that starts
with nothing after the only data node was SIGKILLed takes stage 0 from that copy and goes on from its
step, instead of starting over from step 0 with a fresh embedding and head (what it does under any
other rule when no data node is left to copy)."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS, KILL_AFTER, EVERY = 600, 30, 5  # a step takes ~0.06 s here: the run outlasts the neighbours' first copies


def _steps(path) -> list[dict]:
    return [e for e in progress_events(path) if e["event"] == "step"] if path.exists() else []


def test_a_lost_stage_0_comes_back_from_the_copy_its_neighbours_keep(swarm, tmp_path):
    run = {"train.steps": STEPS, "averaging.mode": "none", "repair.rule": "checkfree_plus",
           "repair.edge_copy_every": EVERY}  # fmt: skip
    run_file = write_tiny_run(tmp_path, **run)
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = [tmp_path / f"worker-{s}.json" for s in (1, 2)]
    workers = [swarm.start_node([entry], "--role", "worker", "--stage", str(s), "--stats-file", str(path), wait=False)
               for s, path in zip((1, 2), stats, strict=True)]  # fmt: skip
    for worker in workers:
        swarm.wait_ready(worker)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    lost = swarm.start_node([entry], "--role", "data", "--progress-file", str(first))
    for worker in workers:  # both neighbours keep a copy before the only holder of stage 0 dies
        wait_until(lambda w=worker: "keeping a copy of stage 0" in w.log(), 60, "a neighbour to keep stage 0")
    wait_until(lambda: len(_steps(first)) >= KILL_AFTER, 60, f"the first data node to train {KILL_AFTER} steps")
    swarm.kill(lost)
    trained = _steps(first)
    newcomer = swarm.start_node([entry], "--role", "data", "--progress-file", str(second))
    done = wait_until(lambda: done_event(second), 180, "the new data node to finish the run")
    for worker in workers:
        swarm.stop(worker)

    taken = re.search(r"stage 0 taken from the copy stage (\d)'s \w+ keeps \(inner step (\d+)\)", newcomer.log())
    assert taken is not None, newcomer.log()[-3000:]
    copied_step = int(taken.group(2))
    assert 0 < copied_step <= len(trained), (copied_step, len(trained))
    resumed = _steps(second)
    assert resumed[0]["step"] == copied_step and resumed[-1]["step"] == STEPS - 1
    assert done["microbatches_abandoned"] == 0, done["abandoned_reasons"]
    # Not a fresh embedding and head: the first loss after the loss is near the lost node's last ones,
    # far below a fresh start's (the first node's step 0).
    fresh, before, after = trained[0]["loss"], trained[-1]["loss"], resumed[0]["loss"]
    print(f"loss: fresh {fresh:.3f}, before the kill {before:.3f}, first step after {after:.3f}")
    assert after < before + 0.3 * (fresh - before), (fresh, before, after)
    kept = [json.loads(path.read_text())["engine"]["edge_copy"] for path in stats]
    assert all(k["fetches"] >= 1 for k in kept) and sum(k["served"] for k in kept) >= 1, kept
