"""Test access to the process launcher `shoal demo` uses (real peers on loopback, ended by pid)."""

from __future__ import annotations

import json

from shoal.demo.launcher import START_TIMEOUT_S, LocalSwarm, Peer, done_event, progress_events, wait_until

__all__ = ["LocalSwarm", "Peer", "Swarm", "done_event", "progress_events", "wait_until"]


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
