"""Stage backups over real daemons (shoal/node/stage/kept_copies.py): the workers of each block stage
keep a copy of the block stage before theirs (the first keeps the last), so a stage whose every
replica is SIGKILLed comes back as it was, not rebuilt from its neighbours; where its keepers are gone
too, CheckFree's rebuild is the fallback, and the node says so in one line.

The run is the post-training setting of tests/test_node_churn.py's repair test (three one-layer block
stages, init std 0.2, a small learning rate, validation after every step), where a rebuilt stage is
far from the one it replaces. Backups every 3 steps.
"""

from __future__ import annotations

import statistics

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(420)]

TTL = "6"
STEPS = 50
RUN = {"train.steps": STEPS, "model.n_layers": 3, "pipeline.stages": 4, "averaging.mode": "none",
       "model.init_std": 0.2, "optim.lr": 2e-3, "train.eval_every": 1, "repair.backup_every": 3}  # fmt: skip
WIPED_AT = 20  # stage 2's only replica dies as step 20's first forward reaches it
BOTH_KILLED_AFTER = 34  # then the restored stage 2 and its keeper, stage 3, die together
WITHIN = 0.05  # the 3-step mean validation loss back within this of its value before the loss ...
IN_STEPS = 10  # ... within this many steps (the backup's restore: at once)


def mean3(val: dict[int, float], first: int) -> float:
    return statistics.fmean(val[s] for s in range(first, first + 3))


def test_a_stage_whose_every_replica_died_comes_back_from_a_backup_and_without_one_is_rebuilt(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **RUN)
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    common = ("--record-ttl", TTL, "--role", "worker")
    crash = {2: ("--inject-crash-at-step", str(WIPED_AT))}
    workers = {
        s: swarm.start_node([entry], *common, "--stage", str(s), *crash.get(s, ()), wait=False) for s in (1, 2, 3)
    }
    for worker in workers.values():
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--record-ttl", TTL, "--progress-file", str(progress))

    # every replica of stage 2 gone: the newcomer takes it back from the backup stage 3 keeps
    wait_until(lambda: not workers[2].alive, 240, f"stage 2's replica to crash at step {WIPED_AT}")
    restored = swarm.start_node([entry], *common, "--stage", "2")
    lines = [line for line in restored.log().splitlines() if "restored from the backup" in line]
    assert len(lines) == 1 and "rebuilt by" not in restored.log(), restored.log()[-3000:]
    assert f"stage 3's {workers[3].peer_id[-8:]} keeps" in lines[0]

    # stage 2 and its keeper die together: stage 2 has no backup left and is rebuilt by CheckFree's rule
    # (from stage 1 alone, stage 3 being lost too), saying so; stage 3 comes back from stage 1's backup
    step = lambda: max((e.get("step", -1) for e in progress_events(progress)), default=-1)  # noqa: E731
    wait_until(lambda: step() >= BOTH_KILLED_AFTER, 240, f"step {BOTH_KILLED_AFTER}")
    swarm.kill(restored)
    swarm.kill(workers[3])
    rebuilt, third = (swarm.start_node([entry], *common, "--stage", str(s), wait=False) for s in (2, 3))
    for peer in (rebuilt, third):
        swarm.wait_ready(peer)
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    fallback = [line for line in rebuilt.log().splitlines() if "no backup of it left" in line]
    assert len(fallback) == 1 and "falling back to checkfree" in fallback[0], rebuilt.log()[-3000:]
    assert "rebuilt by copy from stage(s) [1]" in rebuilt.log()  # CheckFree's rule with one neighbour left
    assert f"restored from the backup stage 1's {workers[1].peer_id[-8:]} keeps" in third.log(), third.log()[-3000:]

    assert done["microbatches_abandoned"] == 0, done["abandoned_reasons"]
    assert done["microbatches_completed"] == done["microbatches_injected"] and done["steps"] == STEPS
    events = progress_events(progress)
    repairs = [(e["stage"], e["rule"]) for e in events if e["event"] == "repair"]
    assert repairs[0] == (2, "backup") and set(repairs[1:]) == {(2, "copy"), (3, "backup")}, repairs
    val = {e["step"]: e["val_loss"] for e in events if e["event"] == "step" and e.get("val_loss") is not None}
    before = val[WIPED_AT - 1]  # the last step the lost replica trained
    back = next((k for k in range(IN_STEPS + 1) if mean3(val, WIPED_AT + k) <= before + WITHIN), None)
    rebuild_jump = max(val[s] - val[s - 1] for s in range(BOTH_KILLED_AFTER + 1, STEPS - 1))
    after = [round(val[s], 3) for s in range(WIPED_AT, WIPED_AT + 4)]
    print("validation loss before the restore", round(before, 3), "then", after, "back within", WITHIN, "after", back,
          "steps; the rebuild's jump", round(rebuild_jump, 3))  # fmt: skip
    assert back == 0, "the restored stage cost more than a step's worth of loss"  # measured: 4.331 -> 4.273
    assert val[WIPED_AT] - before < WITHIN  # no jump at all, where the rebuild without a backup ...
    assert rebuild_jump > 10 * WITHIN  # ... threw the loss up (3.65 -> 4.74, not back 13 steps later)
