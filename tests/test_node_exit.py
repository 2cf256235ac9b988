"""A daemon ends when it is asked to, even when its clean shutdown cannot finish (shoal/node/cli/runtime.py)."""

from __future__ import annotations

import signal
import time

import pytest

from shoal.demo.launcher import wait_until
from shoal.node.cli.runtime import FORCED_EXIT_STATUS
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_a_worker_stuck_in_a_thread_exits_at_its_exit_timeout_or_on_a_second_ctrl_c(swarm, tmp_path):
    """A thread that never returns (an all-reduce stuck in hivemind's lock did) kept a worker alive after
    SIGTERM: Python waits for the event loop's executor threads before it exits (45 s and counting with
    `--exit-timeout 1000`). The watchdog the stop signal starts ends it at `--exit-timeout`, says where
    the threads still running were, and exits 1; Ctrl-C pressed twice ends it at once."""
    exit_timeout_s = 8.0
    run_file = write_tiny_run(tmp_path, **{"pipeline.stages": 2, "model.n_layers": 2, "train.steps": 40})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    flags = ("--role", "worker", "--stage", "1", "--inject-close-stall", "1:600", "--exit-timeout", str(exit_timeout_s))
    stuck = [swarm.start_node([entry], *flags, name=f"stuck{i}") for i in range(2)]
    swarm.start_node([entry], "--role", "data")
    for worker in stuck:  # both replicas hear the close: the data node sends it to every worker it used
        wait_until(lambda w=worker: "close of step 1 is blocked" in w.log(), 120, "the close handling to block")

    terminated, interrupted = stuck
    asked = time.monotonic()
    swarm.kill(terminated, signal.SIGTERM)
    swarm.kill(interrupted, signal.SIGINT)
    time.sleep(0.5)
    swarm.kill(interrupted, signal.SIGINT)
    assert interrupted.process.wait(timeout=5) == FORCED_EXIT_STATUS
    assert "interrupted again: exiting without finishing the shutdown" in interrupted.log()

    status = terminated.process.wait(timeout=exit_timeout_s + 30)  # unbounded, it would wait out the 600 s
    took = time.monotonic() - asked
    log = terminated.log()
    assert status == FORCED_EXIT_STATUS, log[-2000:]
    assert exit_timeout_s - 0.5 < took < exit_timeout_s + 5, took
    assert "left after" in log  # the clean shutdown ran to its end; only the stuck thread was left
    assert f"still running {exit_timeout_s:.0f} s after the stop; exiting without finishing" in log
    # where it waited: the event loop's close joins its executor, whose thread is in the injected sleep
    assert "MainThread at runners.py" in log and " at thread.py" in log, log[-1000:]
