"""A starting allocation for DT-FM's search on large swarms: same-site pipelines, stages banded by strength.

Annealing from a random allocation cannot reach a good region of thousands of nodes in a few hundred
evaluations; this start builds the structure DT-FM's objective rewards directly, and the search only
polishes it (see `allocation.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shoal.planning.dtfm_objective import Parts
from shoal.planning.links import LinkTable


def stage_orders(stages: int) -> list[list[int]]:
    """Stages that take the strength bands in turn, strongest band first: the weakest in the data
    stage with block stages ascending or descending, the strongest in the data stage likewise, and
    a zigzag out from the data stage (strong bands on both sides of it)."""
    blocks = list(range(1, stages))
    zigzag = [0]
    for k in range(len(blocks)):
        zigzag.append(blocks[k // 2] if k % 2 == 0 else blocks[-1 - k // 2])
    orders = [blocks + [0], blocks[::-1] + [0], [0] + blocks, [0] + blocks[::-1], zigzag]
    return [list(o) for o in dict.fromkeys(tuple(o) for o in orders)]


def banded_start(links: LinkTable, sizes: Sequence[int], stage_order: Sequence[int], strength: np.ndarray) -> Parts:
    """A starting allocation: same-site pipelines of the strongest nodes, stages banded by strength.

    `strength` ranks nodes, lowest first (`LinkTable.mean_transfer_s`). There are as many pipelines as the
    smallest stage has nodes (P). Each site offers runs of one node per stage, strongest first, and
    the P runs whose weakest node is strongest are kept; if the sites cannot offer P, the strongest
    nodes left make up the rest, ordered by a site tour so that a mixed pipeline spans close sites.
    A site that keeps k runs sends its k strongest kept nodes to stage_order[0], the next k to
    stage_order[1], and so on: consecutive stages hold the same number of nodes at every site, so
    the matchings can stay inside sites, and weak nodes gather in a few stages, where they slow few
    matchings. The nodes left over (the weakest) fill the room that remains, most of it in the data
    stage, where the closing matching can leave them out of every pipeline.
    """
    n, stages, pipelines = len(links), len(sizes), min(sizes)
    ranked = [int(i) for i in np.lexsort((np.arange(n), strength))]  # strongest first
    by_site: dict[int, list[int]] = {}
    for i in ranked:
        by_site.setdefault(int(links.site[i]), []).append(i)
    runs = sorted(
        (strength[members[(r + 1) * stages - 1]], site, r)
        for site, members in by_site.items()
        for r in range(len(members) // stages)
    )[:pipelines]
    kept = dict.fromkeys(by_site, 0)
    for _, site, _ in runs:
        kept[site] += 1
    parts: Parts = [[] for _ in range(stages)]
    for site, k in kept.items():
        for band, stage in enumerate(stage_order):
            parts[stage] += by_site[site][band * k : (band + 1) * k]
    used = {i for part in parts for i in part}
    left = [i for i in ranked if i not in used]
    mixed = (pipelines - len(runs)) * stages
    tour = {site: rank for rank, site in enumerate(_site_tour(links))}
    rest = sorted(left[:mixed], key=lambda i: (tour[int(links.site[i])], strength[i], i))
    for at in range(0, mixed, stages):
        for band, i in enumerate(sorted(rest[at : at + stages], key=lambda i: (strength[i], i))):
            parts[stage_order[band]].append(i)
    spares = left[mixed:]
    for s, size in enumerate(sizes):
        room = size - len(parts[s])
        parts[s] = sorted(parts[s] + spares[:room])
        spares = spares[room:]
    return parts


def _site_tour(links: LinkTable) -> list[int]:
    """Occupied sites in a nearest-neighbour tour over site-to-site transfer times, from the busiest."""
    count = np.bincount(links.site, minlength=len(links.base_s))
    hop = links.base_s + links.activation_bytes / links.site_Bps
    left = [int(s) for s in np.flatnonzero(count)]
    tour = [max(left, key=lambda s: (count[s], -s))]
    left.remove(tour[0])
    while left:
        here = tour[-1]
        nearest = min(left, key=lambda s: (hop[here, s] + hop[s, here], s))
        tour.append(nearest)
        left.remove(nearest)
    return tour
