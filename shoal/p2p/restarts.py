"""Peers that came back under the same peer id (`--state-dir` and `--identity` keep it).

A restarted process keeps its peer id but nothing it held in flight: the activations and graphs
of its microbatches died with the old process, and it will never answer for them. Its node record
shows it: a later `started_at`. For the microbatches routed through it before, a data node then does
what it does for a peer that left (a new attempt before they came home, the lost hop redone after),
instead of waiting for them to time out; a stage worker drops the graphs it keeps for microbatches a
restarted data node injected (they would hold back its next inner step until they expire); and every
engine lifts its ban on it (the ban was earned by the old process).
"""

from __future__ import annotations

from shoal.planning.swarm_view import PeerID, SwarmView


class RestartWatch:
    """Remembers when each peer it has seen started, and tells which ones started again since."""

    def __init__(self) -> None:
        self.started: dict[PeerID, float] = {}

    def restarted(self, view: SwarmView) -> set[PeerID]:
        found = set()
        for node in view.live_nodes():
            before = self.started.get(node.peer_id)
            if before is not None and node.started_at > before:
                found.add(node.peer_id)
            self.started[node.peer_id] = max(before or 0.0, node.started_at)
        return found
