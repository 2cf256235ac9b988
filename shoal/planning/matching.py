"""Bottleneck bipartite matching: pair the nodes of two stages so the slowest pair is as fast as possible.

DT-FM scores the link between two pipeline stages by this value and chains the matched pairs into
its fixed pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import permutations


def bottleneck_matching(weights: Sequence[Sequence[float]]) -> tuple[float, tuple[int, ...]]:
    """Match every row to a distinct column minimising the largest matched weight.

    Needs rows <= columns. Returns (bottleneck, column of each row). Up to five columns by
    enumeration; beyond, a binary search over the candidate thresholds (none below the largest row
    minimum) with augmenting-path matching.
    """
    rows = len(weights)
    if rows == 0:
        return 0.0, ()
    cols = len(weights[0])
    if rows > cols:
        raise ValueError(f"cannot match {rows} rows into {cols} columns")
    if cols <= 5:  # enumeration is cheaper than augmenting paths at DT-FM's stage sizes
        return min((max(weights[r][c] for r, c in enumerate(perm)), perm) for perm in permutations(range(cols), rows))
    floor = max(min(row) for row in weights)
    thresholds = sorted({w for row in weights for w in row if w >= floor})
    lo, hi = 0, len(thresholds) - 1
    found = _match_under(weights, thresholds[hi])
    assert found is not None, "a full bipartite graph always has a matching"
    while lo < hi:
        mid = (lo + hi) // 2
        m = _match_under(weights, thresholds[mid])
        if m is None:
            lo = mid + 1
        else:
            hi, found = mid, m
    return thresholds[hi], found


def _match_under(weights: Sequence[Sequence[float]], limit: float) -> tuple[int, ...] | None:
    """A matching of every row using only edges of weight <= limit (Kuhn's algorithm), or None."""
    rows, cols = len(weights), len(weights[0])
    owner = [-1] * cols

    def augment(r: int, seen: list[bool]) -> bool:
        for c in range(cols):
            if weights[r][c] <= limit and not seen[c]:
                seen[c] = True
                if owner[c] < 0 or augment(owner[c], seen):
                    owner[c] = r
                    return True
        return False

    for r in range(rows):
        if not augment(r, [False] * cols):
            return None
    col_of = [0] * rows
    for c, r in enumerate(owner):
        if r >= 0:
            col_of[r] = c
    return tuple(col_of)
