"""A node's planned future: when it computes, and which microbatches it holds in memory.

Collision-aware planning books every task into these timelines, so two microbatches never share
a node at once (one waits for the other) and a node never holds more than its memory allows.
"""

from __future__ import annotations

from bisect import bisect_right, insort

_EPS = 1e-9


class Timeline:
    """Busy intervals (sorted, disjoint) and residency intervals of one node. Planner-internal."""

    __slots__ = ("starts", "ends", "held_ends")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.held_ends: list[float] = []  # end times of residencies, sorted

    def earliest_slot(self, ready_s: float, duration_s: float) -> float:
        """First start >= ready_s where the node is free for duration_s."""
        t = ready_s
        i = bisect_right(self.ends, t + _EPS)
        while i < len(self.starts):
            if self.starts[i] >= t + duration_s - _EPS:
                return t
            t = max(t, self.ends[i])
            i += 1
        return t

    def book(self, start_s: float, duration_s: float) -> None:
        i = bisect_right(self.starts, start_s)
        self.starts.insert(i, start_s)
        self.ends.insert(i, start_s + duration_s)

    def held_after(self, t: float) -> int:
        """Residencies not yet over at t (a safe bound on what is held at any time from t on)."""
        return len(self.held_ends) - bisect_right(self.held_ends, t + _EPS)

    def free_memory_from(self, t: float, memory: int) -> float:
        """Earliest time >= t from which fewer than `memory` booked residencies remain."""
        if len(self.held_ends) < memory:
            return t
        return max(t, self.held_ends[len(self.held_ends) - memory])

    def hold(self, end_s: float) -> None:
        insort(self.held_ends, end_s)
