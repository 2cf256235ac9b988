"""Transfer times between many nodes at once: `CostModel.transfer_s` over arrays.

DT-FM's allocation scores hundreds of thousands of node pairs per move at 5,000 nodes, so it reads
blocks of this table instead of calling `transfer_s` per pair. Up to FULL_TABLE_UP_TO nodes every
pair is precomputed; beyond, only the per-site tables and each node's access cap are kept and a
block is computed on demand, so 5,000 nodes never hold a 25-million-entry matrix. The arithmetic is
`transfer_s`'s, in the same order, so both agree to the last bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from shoal.planning.costs import CostModel
from shoal.planning.swarm import PlanNode, Swarm

FULL_TABLE_UP_TO = 2000  # nodes: a full table of 32 MB; beyond, blocks are computed on demand


@dataclass(frozen=True, eq=False)
class LinkTable:
    """One activation's transfer time between any two of `nodes`, addressed by position in `nodes`."""

    site: np.ndarray  # (n,) int: each node's site
    cap_Bps: np.ndarray  # (n,) each node's own access bandwidth (inf: no cap)
    base_s: np.ndarray  # (sites, sites) per-hop overhead + one-way latency
    site_Bps: np.ndarray  # (sites, sites) bandwidth between sites
    activation_bytes: float
    full: np.ndarray | None = None  # (n, n) every block precomputed, for swarms up to FULL_TABLE_UP_TO nodes

    @classmethod
    def build(cls, swarm: Swarm, cost: CostModel, nodes: Sequence[PlanNode]) -> LinkTable:
        table = cls(
            site=np.array([n.site for n in nodes], dtype=np.intp),
            cap_Bps=np.array([n.bandwidth_Bps for n in nodes], dtype=float),
            base_s=cost.per_hop_overhead_s + np.array(swarm.latency_s, dtype=float).reshape(len(swarm.latency_s), -1),
            site_Bps=np.array(swarm.bandwidth_Bps, dtype=float).reshape(len(swarm.bandwidth_Bps), -1),
            activation_bytes=cost.activation_bytes,
        )
        if len(nodes) > FULL_TABLE_UP_TO:
            return table
        everyone = np.arange(len(nodes))
        return replace(table, full=table.block(everyone, everyone))

    def __len__(self) -> int:
        return len(self.site)

    def block(self, rows: np.ndarray | Sequence[int], cols: np.ndarray | Sequence[int]) -> np.ndarray:
        """Seconds from each node of `rows` to each node of `cols`, shape (len(rows), len(cols))."""
        r, c = np.asarray(rows, dtype=np.intp), np.asarray(cols, dtype=np.intp)
        return self.pairwise(r[:, None], c[None, :])

    def pairwise(self, a: np.ndarray | Sequence[int], b: np.ndarray | Sequence[int]) -> np.ndarray:
        """Seconds from a[k] to b[k], elementwise (numpy broadcasting applies)."""
        a, b = np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp)
        if self.full is not None:
            return self.full[a, b]
        sa, sb = self.site[a], self.site[b]
        bandwidth = np.minimum(np.minimum(self.site_Bps[sa, sb], self.cap_Bps[a]), self.cap_Bps[b])
        return np.where(a == b, 0.0, self.base_s[sa, sb] + self.activation_bytes / bandwidth)  # 0 within a node

    def mean_transfer_s(self) -> np.ndarray:
        """Each node's mean transfer time to every node (itself included), a block of one site at a time."""
        everyone = np.arange(len(self))
        total = np.zeros(len(self))
        for site in np.unique(self.site):
            total += self.block(everyone, np.flatnonzero(self.site == site)).sum(axis=1)
        return total / len(self)

    def slowest_within(self, members: np.ndarray | Sequence[int]) -> float:
        """The slowest link between two distinct `members` (0 when fewer than two): the max of their block."""
        if self.full is None:
            return self.slowest_pair(members)[0]
        m = np.asarray(members, dtype=np.intp)
        return float(self.full[m[:, None], m].max()) if m.size >= 2 else 0.0

    def slowest_pair(self, members: np.ndarray | Sequence[int]) -> tuple[float, int, int]:
        """The slowest link between two distinct `members` and its two ends; (0, -1, -1) for fewer than two.

        A link's time depends only on the two sites and the weaker of the two caps, so per pair of
        sites the slowest link is the one between each site's weakest member (within one site, the
        weakest and any other): O(members + sites²) instead of O(members²), and the same number.
        """
        m = np.asarray(members, dtype=np.intp)
        if m.size < 2:
            return 0.0, -1, -1
        ranked = m[np.lexsort((m, self.cap_Bps[m], self.site[m]))]  # by site, weakest first
        _, first, count = np.unique(self.site[ranked], return_index=True, return_counts=True)
        weakest = ranked[first]  # the weakest member at each site present
        other = ranked[np.minimum(first + 1, len(ranked) - 1)]  # a second member there, where there is one
        same_site = np.eye(len(first), dtype=bool)
        partner = np.where(same_site, other[:, None], weakest[None, :])
        times = np.where(same_site & (count < 2)[:, None], -np.inf, self.pairwise(weakest[:, None], partner))
        p, q = np.unravel_index(int(times.argmax()), times.shape)
        return float(times[p, q]), int(weakest[p]), int(partner[p, q])
