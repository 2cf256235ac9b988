"""Bottleneck bipartite matching: pair the nodes of two stages so the slowest pair is as fast as possible.

DT-FM scores the link between two pipeline stages by this value and chains the matched pairs into
its fixed pipelines.

Beyond five columns the matching grows under a limit that rises but never passes the optimum. It
starts at a lower bound (every row must take some edge, so the bottleneck is at least the largest
row minimum, and, when square, the largest column minimum), where each row in turn takes its
lightest free column. Each row left over is then added by a breadth-first augmenting path under
the limit; when there is none, the limit rises to the lightest edge leaving the rows that search
reached, and the search repeats. Every edge used is no heavier than the optimum, so the result is
optimal: a matching within the edges <= the optimum that is not yet full always has an augmenting
path from any unmatched row within those edges (its symmetric difference with an optimal matching
holds one). The result is a function of the weights alone, so callers may memoise it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from itertools import permutations

import numpy as np

ENUMERATE_UP_TO = 5  # columns; enumeration is cheaper than augmenting paths at DT-FM's stage sizes


def bottleneck_matching(weights: Sequence[Sequence[float]] | np.ndarray) -> tuple[float, tuple[int, ...]]:
    """Match every row to a distinct column minimising the largest matched weight.

    Needs rows <= columns. Returns (bottleneck, column of each row). Up to five columns by
    enumeration (the lexicographically first best assignment); beyond, by augmenting paths under a
    rising limit (module docstring).
    """
    rows = len(weights)
    if rows == 0:
        return 0.0, ()
    cols = len(weights[0])
    if rows > cols:
        raise ValueError(f"cannot match {rows} rows into {cols} columns")
    w = np.asarray(weights, dtype=float)
    if cols <= ENUMERATE_UP_TO:
        perms = _assignments(rows, cols)
        best = int(w[np.arange(rows), perms].max(axis=1).argmin())  # the first best in lexicographic order
        return float(w[np.arange(rows), perms[best]].max()), tuple(perms[best].tolist())
    level = w.min(axis=1).max()
    if rows == cols:
        level = max(level, w.min(axis=0).max())
    col_of = np.full(rows, -1, dtype=np.intp)
    row_of = np.full(cols, -1, dtype=np.intp)
    _extend_under(w, level, col_of, row_of)
    for r in np.flatnonzero(col_of < 0):
        while (higher := _augment_under(w, level, int(r), col_of, row_of)) is not None:
            level = higher
    return float(w[np.arange(rows), col_of].max()), tuple(col_of.tolist())


@cache
def _assignments(rows: int, cols: int) -> np.ndarray:
    """Every injective map of rows into columns, in lexicographic order, shape (count, rows)."""
    return np.array(list(permutations(range(cols), rows)), dtype=np.intp).reshape(-1, rows)


def _extend_under(w: np.ndarray, limit: float, col_of: np.ndarray, row_of: np.ndarray) -> None:
    """Greedily: each unmatched row in turn takes its lightest free column with weight <= limit (in place)."""
    free = row_of < 0
    for r in np.flatnonzero(col_of < 0):
        allowed = np.where(free, w[r], np.inf)
        c = int(allowed.argmin())
        if allowed[c] <= limit:
            col_of[r], row_of[c], free[c] = c, r, False


def _augment_under(w: np.ndarray, limit: float, start: int, col_of: np.ndarray, row_of: np.ndarray) -> float | None:
    """Match row `start` along an augmenting path of edges <= limit, found breadth first (in place).

    Returns None once matched. Otherwise nothing changes and it returns the lightest edge out of
    the rows the search reached: no path exists below that weight, so raising the limit to it
    never overshoots the optimum.
    """
    via = np.full(len(row_of), -1, dtype=np.intp)  # the row the search entered each column from
    seen = np.zeros(len(row_of), dtype=bool)
    frontier, reached = np.array([start]), [np.array([start])]
    while frontier.size:
        hit = (w[frontier] <= limit) & ~seen
        cols = np.flatnonzero(hit.any(axis=0))
        via[cols] = frontier[hit[:, cols].argmax(axis=0)]
        seen[cols] = True
        free = cols[row_of[cols] < 0]
        if free.size:
            _flip(start, int(free[0]), via, col_of, row_of)
            return None
        frontier = row_of[cols]
        reached.append(frontier)
    return float(w[np.concatenate(reached)][:, ~seen].min())


def _flip(start: int, col: int, via: np.ndarray, col_of: np.ndarray, row_of: np.ndarray) -> None:
    """Augment along the path that ends at free column `col`, following `via` back to row `start`."""
    while True:
        row = int(via[col])
        previous = col_of[row]
        col_of[row], row_of[col] = col, row
        if row == start:
            return
        col = int(previous)
