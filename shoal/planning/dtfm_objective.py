"""DT-FM's objective (Yuan et al., NeurIPS 2022): DP_cost + 2 * PP_cost of a node-to-stage allocation.

DP_cost is the slowest link inside any stage (its replicas all-reduce); PP_cost sums, over
consecutive stages, the bottleneck of a matching between their nodes, and the matched nodes form
DT-FM's fixed pipelines. Two choices are ours and stated: a link's weight is the transfer time of
one activation (the authors' scheduler also builds both costs from one delay matrix), and, because
a microbatch's loss lives on its data node, the closing hop back to the data node is part of
PP_cost.

A search evaluates thousands of allocations that differ in two stages, so every term is memoised
by its inputs (`Memo`): a swap recomputes only the two DP terms, the matchings it touches and the
closing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shoal.planning.costs import CostModel
from shoal.planning.links import LinkTable
from shoal.planning.matching import ENUMERATE_UP_TO, bottleneck_matching
from shoal.planning.swarm import Swarm

Parts = list[list[int]]  # node positions (in node-id order) per stage, each list sorted
Chains = list[list[int]]  # pipelines as positions: data node, then one node per block stage

MEMO_CELLS = 4_000_000  # memo bound, in node positions held by its keys (a few tens of MB)


class Memo:
    """The objective's terms by their inputs (stage members, chain ends), so a move that changes two
    stages recomputes only the terms it touches. Forgotten wholesale once its keys hold `limit`
    node positions, which bounds memory at any swarm size."""

    def __init__(self, limit: int = MEMO_CELLS) -> None:
        self.values: dict[tuple, object] = {}
        self.cells, self.limit = 0, limit

    def get(self, key: tuple, compute: Callable[[], object]):
        value = self.values.get(key)
        if value is None:
            size = sum(map(len, key[1:]))
            if self.cells + size > self.limit:
                self.values.clear()
                self.cells = 0
            value = self.values[key] = compute()
            self.cells += size
        return value


def objective(parts: Parts, links: LinkTable, memo: Memo | None = None) -> tuple[float, list[list[int]]]:
    """DP_cost + 2 * PP_cost of a partition (node positions in `links` per stage), and the pipelines
    its matchings chain together."""
    memo = Memo() if memo is None else memo
    dp = 0.0
    for part in parts:
        members = tuple(part)
        dp = max(dp, memo.get(("dp", members), lambda m=members: links.slowest_within(m)))
    pp, chains = pipeline_chains(parts, links, memo)
    return dp + 2.0 * pp, chains


def _match_chains(
    kind: str,
    keys: tuple,
    others: tuple[int, ...],
    weigh: Callable[[tuple, tuple[int, ...]], np.ndarray],
    memo: Memo,
) -> tuple[float, tuple[int, ...]]:
    """Memoised bottleneck matching between chains (one key each, in chain order) and the nodes
    `others`, weighted by weigh(keys, others) of shape (chains, others); the smaller side is matched
    into the larger. Returns (bottleneck, each item of the smaller side's partner, as an index).

    Beyond ENUMERATE_UP_TO a side the chains are matched in key order, so the result depends on the
    two sets alone and stays memoised however upstream matchings reorder the chains. Up to it the
    chain order is kept, and with it the enumeration's tie-break (the paper setting is unchanged).
    """

    def solve(rows: tuple) -> tuple[float, tuple[int, ...]]:
        weights = weigh(rows, others)
        return bottleneck_matching(weights if len(rows) <= len(others) else weights.T)

    if max(len(keys), len(others)) <= ENUMERATE_UP_TO:
        return memo.get((kind, keys, others), lambda: solve(keys))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    ranked = tuple(keys[k] for k in order)
    value, cols = memo.get((kind, ranked, others), lambda: solve(ranked))
    if len(keys) > len(others):  # cols index the ranked chains
        return value, tuple(order[c] for c in cols)
    partner = [0] * len(keys)
    for k, col in zip(order, cols, strict=True):
        partner[k] = col
    return value, tuple(partner)


def pipeline_chains(
    parts: Sequence[Sequence[int]], links: LinkTable, memo: Memo | None = None
) -> tuple[float, list[list[int]]]:
    """Chain stage 1 .. S-1 by successive bottleneck matchings, then match each chain to a data node.

    Returns (PP_cost, chains as [data node, stage-1 node, ...]), nodes as positions in `links`.
    There are as many chains as the smallest stage has nodes.
    """
    memo = Memo() if memo is None else memo
    chains = [[i] for i in parts[1]]
    pp = 0.0
    for part in parts[2:]:
        part = tuple(part)
        ends = tuple(c[-1] for c in chains)
        value, cols = _match_chains("link", ends, part, links.block, memo)
        if len(ends) <= len(part):
            chains = [c + [part[col]] for c, col in zip(chains, cols, strict=True)]
        else:  # fewer nodes here than chains: keep the chains the matching picks
            chains = [chains[col] + [j] for j, col in zip(part, cols, strict=True)]
        pp += value
    data = tuple(parts[0])

    def closing(pairs: tuple, data: tuple[int, ...]) -> np.ndarray:
        firsts, lasts = [f for f, _ in pairs], [last for _, last in pairs]
        return links.block(data, firsts).T + links.block(lasts, data)  # out of the data node and back

    value, cols = _match_chains("closing", tuple((c[0], c[-1]) for c in chains), data, closing, memo)
    if len(chains) <= len(data):
        chains = [[data[col]] + c for c, col in zip(chains, cols, strict=True)]
    else:
        chains = [[data[d]] + chains[col] for d, col in enumerate(cols)]
    return pp + value, chains


def dtfm_cost(swarm: Swarm, cost: CostModel) -> float:
    """DP_cost + 2 * PP_cost of the swarm's allocation as it stands (to compare a search against)."""
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    index = {n.node_id: i for i, n in enumerate(nodes)}
    parts = [[index[n.node_id] for n in group] for group in swarm.by_stage]
    return objective(parts, LinkTable.build(swarm, cost, nodes))[0]
