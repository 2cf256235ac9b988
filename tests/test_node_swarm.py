"""A real swarm: a bootstrap peer and nodes as processes on loopback, ended by pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shoal.demo.launcher import shoal_command
from tests.helpers.processes import wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

TTL = "6"  # seconds: short so that a killed node expires within the test


@pytest.fixture
def run_file(tmp_path):
    """A hermetic three-stage run: its corpus is written by the test, so no Debian package is needed."""
    return write_tiny_run(tmp_path)


def _status_when(swarm, entry: str, count: int, what: str, *extra: str, timeout_s: float = 40) -> dict:
    def check():
        doc = swarm.status(entry, *extra)
        return doc if len(doc["nodes"]) == count else None

    return wait_until(check, timeout_s, what)


def _stages(doc: dict) -> dict[int, int]:
    return {s["stage"]: s["replicas"] for s in doc["stages"]}


def _export_loads_in_transformers(entry: str, out) -> None:
    """`shoal export` takes every stage from a live replica (stage 0 from the data node) into a
    checkpoint that `transformers` loads offline and runs."""
    done = subprocess.run(shoal_command("export", "--initial-peers", entry, "--out", str(out)),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stderr.splitlines() if line.startswith("stage")] == [
        "stage 0", "stage 1", "stage 2"
    ]  # fmt: skip
    script = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        f"ids = AutoTokenizer.from_pretrained({str(out)!r})('the swarm', return_tensors='pt').input_ids\n"
        "print(bool(torch.isfinite(model(input_ids=ids).logits).all()))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert loaded.returncode == 0 and loaded.stdout.strip() == "True", loaded.stderr


def test_swarm_forms_covers_stages_and_heals_after_a_crash(swarm, run_file, tmp_path):
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file))
    entry = bootstrap.maddrs[0]
    nodes = [swarm.start_node([entry], "--record-ttl", TTL, wait=False) for _ in range(3)]
    for node in nodes:
        swarm.wait_ready(node)

    doc = _status_when(swarm, entry, 3, "3 nodes in status")
    assert doc["run"]["name"] == "test-tiny" and doc["run"]["stages"] == 3
    assert {n["peer_id"] for n in doc["nodes"]} == {n.peer_id for n in nodes}
    assert _stages(doc) == {0: 1, 1: 1, 2: 1}, doc["stages"]
    assert all(n["state"] == "active" and n["throughput"] > 0 for n in doc["nodes"])

    victim = next(n for n in nodes if n.stage != 0)
    swarm.kill(victim)
    killed_at = time.monotonic()
    doc = _status_when(swarm, entry, 2, "the crash to show")
    assert time.monotonic() - killed_at <= float(TTL) + 10  # gone within its TTL (+ one status round trip)
    assert victim.peer_id not in {n["peer_id"] for n in doc["nodes"]}
    assert _stages(doc)[victim.stage] == 0

    newcomer = swarm.start_node([entry], "--record-ttl", TTL)
    assert newcomer.stage == victim.stage
    doc = _status_when(swarm, entry, 3, "the newcomer")
    assert _stages(doc) == {0: 1, 1: 1, 2: 1}
    _export_loads_in_transformers(entry, tmp_path / "exported")

    started = time.monotonic()
    assert swarm.stop(newcomer) == 0  # SIGTERM: announce leaving, drain, exit 0
    assert time.monotonic() - started < 10


def test_swarm_survives_its_bootstrap_peer(swarm, run_file):
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file))
    first = swarm.start_node([bootstrap.maddrs[0]], "--record-ttl", TTL)
    second = swarm.start_node([bootstrap.maddrs[0]], "--record-ttl", TTL)
    swarm.kill(bootstrap)

    # A newcomer that never saw the bootstrap peer joins through a surviving node.
    third = swarm.start_node([first.maddrs[0]], "--record-ttl", TTL, "--run", "test-tiny")
    doc = _status_when(swarm, second.maddrs[0], 3, "three nodes after the bootstrap died", "--run", "test-tiny")
    assert {n["peer_id"] for n in doc["nodes"]} == {first.peer_id, second.peer_id, third.peer_id}
    assert _stages(doc) == {0: 1, 1: 1, 2: 1}


def test_unreachable_initial_peers_are_one_clear_line_each():
    dead = "/ip4/127.0.0.1/tcp/1/p2p/QmdXVs4L4mshd12VtyNZ4EzZkmTj1x4aBPkZr6pVCxEd2K"
    result = subprocess.run(shoal_command("node", "--initial-peers", dead, "--join-timeout", "1"), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "shoal node: error: could not join the swarm in 1 s (none of them answered); each initial peer:",
        f"  {dead}: TCP refused at 127.0.0.1:1: nothing listens there (is the peer up, on that port?)",
    ]
