"""Test access to the process launcher `shoal demo` uses (real peers on loopback, ended by pid)."""

from __future__ import annotations

from shoal.demo.launcher import LocalSwarm, Peer, done_event, progress_events, wait_until

__all__ = ["LocalSwarm", "Peer", "Swarm", "done_event", "progress_events", "wait_until"]


class Swarm(LocalSwarm):
    """In tests, leftovers are killed outright at the end: nothing they write is needed."""

    def close(self, timeout_s: float = 0.0) -> None:
        super().close(timeout_s)
