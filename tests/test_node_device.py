"""Real daemons choose their stage by the memory they have: a node whose memory holds a block stage but
not stage 0 takes a block stage even where the swarm has no data node yet, and says why in its log
and in `shoal status`; a node that holds no stage exits 2 naming what the smallest needs. Every
node's record shows its device, memory and speed.

Run: .venv/bin/python -m pytest tests/test_node_device.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.node.capacity import stage_need
from shoal.planning.memory import GIB, HEADROOM
from shoal.run_files import load_run_config
from tests.helpers.processes import wait_until
from tests.helpers.tiny import sample_text, write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[1]


def test_a_node_takes_the_stage_its_memory_holds_or_exits_2_saying_what_it_lacks(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 4, "pipeline.stages": 5})  # one block per stage
    run = load_run_config(str(run_file))
    head, block = stage_need(run, 0).total(1), stage_need(run, 1).total(1)
    assert block < head, "the test needs stage 0 to be the larger"
    between = f"{(block + head) / 2 / (1 - HEADROOM) / GIB:.9f}"  # GiB that hold a block stage, not stage 0
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]

    # alone in the swarm, it would take the data role; its memory sends it to a block stage
    small = swarm.start_node([entry], "--memory-limit", between, "--device", "cpu")
    assert small.stage in range(1, run.pipeline.stages)
    log = small.log()
    assert "stage 0 (the data role) needs ~" in log and f"taking stage {small.stage}" in log
    assert "computing on cpu (" in log and "in float32" in log

    def listed() -> dict | None:
        doc = swarm.status(entry)
        mine = [n for n in doc["nodes"] if n["peer_id"] == small.peer_id]
        return mine[0] if mine and mine[0]["device"] is not None else None

    shown = wait_until(listed, 60, "the node in shoal status")
    device = shown["device"]
    assert device["kind"] == "cpu" and device["compute_dtype"] == "float32" and device["tokens_per_s"] > 0
    assert 0 < device["free_bytes"] <= device["total_bytes"]
    assert device["planned_bytes"] == int(float(between) * GIB)
    assert shown["placement_note"].startswith("stage 0 (the data role) needs ~")

    # too little for any stage: one line, exit 2, before it takes anything
    refused = swarm.start_node([entry], "--memory-limit", f"{block / 2 / GIB:.9f}", wait=False)
    refused.process.wait(timeout=120)
    log = refused.log()
    assert refused.process.returncode == 2 and "Traceback" not in log, log[-2000:]
    assert f"no stage of run {run.name} fits this node: stage " in log and "(--memory-limit)" in log


def test_the_device_check_runs_in_its_quick_form(tmp_path):
    """benchmarks/device_check.py --quick: tiny, locally and as a three-node swarm on the device auto
    finds (the CPU in CI); it exits 1 if parity breaks or a microbatch is abandoned."""
    out, corpus = tmp_path / "device_check.json", tmp_path / "corpus.txt"
    corpus.write_text(sample_text(300000))  # a fresh machine has no default corpus; 1.8 MB: a validation split
    script = ROOT / "benchmarks" / "device_check.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out), "--data", str(corpus)],
                            cwd=ROOT, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    (check,) = doc["checks"]
    assert check["parity"] and check["swarm"]["abandoned"] == 0 and check["steps"] == 6
    assert check["local"]["device"] == doc["device"] and set(check["swarm"]["devices"].values()) == {doc["device"]}
    assert all(peak > 0 for peak in check["swarm"]["peak_bytes"].values()) and check["local"]["peak_bytes"] > 0
