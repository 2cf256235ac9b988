"""`shoal demo` end to end: a real multi-process swarm trains and reports, every microbatch accounted for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]


def test_demo_trains_a_local_swarm_through_a_crash_and_a_stage_wipe_and_writes_the_report(tmp_path):
    run_file = write_tiny_run(tmp_path)
    report_dir = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "demo",
            "--run-config",
            str(run_file),
            "--steps",
            "64",  # room for 2 averagings (H = 10) after the wipe at step 20
            "--workers-per-stage",
            "2",
            "--crash-at-step",
            "8",
            "--kill-stage",
            "2",
            "--at-step",
            "20",  # well after the crash at step 8: two faults at once may lose a microbatch for good
            "--repair",
            "checkfree_plus",
            "--restart-after",
            "1",  # the killed workers come back while the run still has steps to go
            "--report",
            str(report_dir),
            "--quiet",
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((report_dir / "report.json").read_text())
    assert (report_dir / "loss.png").stat().st_size > 1000
    assert report["steps"] == 64
    assert report["final_loss"] < 0.8 * report["initial_loss"]
    assert report["microbatches_completed"] + report["microbatches_abandoned"] == report["microbatches_injected"]
    assert sum(report["abandoned_reasons"].values()) == report["microbatches_abandoned"]
    assert report["crash"]["signal"] == "SIGKILL"
    assert report["wipe"]["stage"] == 2 and len(report["wipe"]["peer_ids"]) == 2
    # the faults land at the steps asked (a step here takes ~50 ms; the demo looks every 20 ms)
    assert 8 <= report["crash"]["step"] <= 10 and 20 <= report["wipe"]["step"] <= 22
    (repair,) = report["repairs"]  # the new node copied stage 2's swap partner, stage 1
    assert (repair["stage"], repair["rule"], repair["sources"]) == (2, "copy_partner", [1])
    assert repair["step"] >= 20 and repair["loss_before"] is not None and repair["loss_after"] is not None
    # the killed workers were started again (--restart-after): every block stage ends at 2 replicas
    assert sorted(r["stage"] for r in report["restarts"]) == [1, 2], report["restarts"]
    assert report["replicas_at_end"] == {"1": 2, "2": 2}
    states = [n["state"] for n in report["nodes"]]
    assert states.count("crashed") == 3 and states.count("stopped") == len(states) - 3
    assert all(n["exit_code"] == 0 for n in report["nodes"] if n["state"] == "stopped")
    assert report["microbatches_abandoned"] == 0  # the crash cost re-sends and redone hops, not microbatches
    averaging = report["averaging"]
    assert averaging["mode"] == "noloco" and set(averaging["stages"]) == {"1", "2"}
    # 64 steps, H = 10: a wipe by step 22 leaves the rebuilt stage's replica the averagings after steps 30 to 60
    assert all(stage["outer_steps"] >= 2 for stage in averaging["stages"].values())
