"""`shoal health` against a real node: exit 0 with one line for a live node, 1 for a dead address."""

from __future__ import annotations

import subprocess

import pytest

from shoal.demo.launcher import shoal_command
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

DEAD = "/ip4/127.0.0.1/tcp/1/p2p/QmdXVs4L4mshd12VtyNZ4EzZkmTj1x4aBPkZr6pVCxEd2K"


def health(*args: str) -> subprocess.Popen:
    return subprocess.Popen(shoal_command("health", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outcome(process: subprocess.Popen) -> tuple[int, list[str], list[str]]:
    out, err = process.communicate(timeout=90)
    return process.returncode, out.strip().splitlines(), err.strip().splitlines()


def test_health_of_a_live_node_a_dead_address_and_a_missing_ready_file(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"pipeline.stages": 2})
    node = swarm.start_node([], "--run-config", str(run_file), "--role", "worker", wait=False)  # a swarm of one
    # each check starts a libp2p daemon of its own: those that need no node run while it starts
    checks = {
        "dead": health("--peer", DEAD, "--timeout", "20"),
        "no ready file": health("--ready-file", str(tmp_path / "missing.json")),
    }
    swarm.wait_ready(node)
    assert node.ready_file is not None
    checks |= {"peer": health("--peer", node.maddrs[0]), "ready file": health("--ready-file", str(node.ready_file))}
    results = {name: outcome(process) for name, process in checks.items()}

    for name in ("peer", "ready file"):
        code, out, err = results[name]
        assert code == 0, (name, out, err)
        assert len(out) == 1 and not err, (name, out, err)
        assert out[0].startswith(f"healthy: node …{node.peer_id[-8:]} is active, stage 1, protocol "), out
    assert results["dead"] == (1, [], [f"unhealthy: no answer from {DEAD} (cannot connect)"])
    code, out, err = results["no ready file"]
    assert (code, out) == (1, []) and len(err) == 1 and err[0].startswith("unhealthy: no ready file at "), err
    assert node.alive


def test_health_needs_a_full_peer_address():
    result = subprocess.run(
        shoal_command("health", "--peer", "/ip4/127.0.0.1/tcp/31337"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "shoal health: error: --peer /ip4/127.0.0.1/tcp/31337: the address must end in /p2p/PEER_ID"
    ]
