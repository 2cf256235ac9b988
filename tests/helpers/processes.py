"""Test access to the process launcher `shoal demo` uses (real peers on loopback, ended by pid)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from shoal.demo.launcher import START_TIMEOUT_S, LocalSwarm, Peer, done_event, progress_events, wait_until

__all__ = ["LocalSwarm", "Peer", "Swarm", "done_event", "metrics", "progress_events", "wait_until"]


def metrics(peer: Any) -> dict[str, float]:
    """A daemon's Prometheus metrics (started with `--metrics-port 0`): `name{labels}` -> value."""
    port = json.loads(Path(peer.ready_file).read_text())["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


class Swarm(LocalSwarm):
    """In tests, leftovers are killed outright at the end: nothing they write is needed."""

    def close(self, timeout_s: float = 0.0) -> None:
        super().close(timeout_s)

    def start_dashboard(self, initial_peer: str, *extra: str) -> tuple[Peer, str]:
        """`shoal dashboard` on a free loopback port; returns it and its URL once it serves."""
        ready = self.workdir / f"dashboard-{len(self.peers):02d}.json"
        args = ["dashboard", "--initial-peers", initial_peer, "--port", "0", "--ready-file", str(ready), *extra]
        peer = self._spawn(args, "dashboard")

        def serving() -> bool:
            if not peer.alive:
                raise RuntimeError(f"the dashboard exited with {peer.process.returncode}:\n{peer.log()[-3000:]}")
            return ready.exists()

        wait_until(serving, START_TIMEOUT_S, "the dashboard to serve")
        return peer, json.loads(ready.read_text())["url"]
