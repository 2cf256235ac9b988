"""Node-to-stage allocation by DT-FM's objective (Yuan et al., NeurIPS 2022), as SkipPipe's phase A.

DT-FM minimises DP_cost + 2 * PP_cost: DP_cost is the slowest link inside any stage (its replicas
all-reduce), PP_cost sums, over consecutive stages, the bottleneck of a matching between their
nodes; the matched nodes form its fixed pipelines. The authors search with a genetic algorithm.

Two choices are ours and stated: a link's weight is the transfer time of one activation (the
authors' scheduler also builds both costs from one delay matrix), and, because a microbatch's
loss lives on its data node, the closing hop back to the data node is part of PP_cost.

The search depends on the swarm's size. Where every swap of two nodes can be tried (the paper's
20 nodes have 175 moves), it is seeded simulated annealing with restarts (move one pair of nodes
between stages, or relabel two whole block stages), then a climb to a local optimum over every
move. Beyond, it starts from same-site pipelines banded by strength (`banded_start`, the best of
a few stage orders) and climbs over swaps of the nodes on the objective's bottlenecks, with a
bounded number of evaluations. Either way the objective is memoised per stage and per pair of
stages, so a move that changes two stages recomputes only their DP terms, the matchings they touch
and the closing; delays come in blocks from a `LinkTable`, and matchings grow by augmenting paths
under a rising limit (see `matching.py`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.planning.costs import CostModel
from shoal.planning.links import LinkTable
from shoal.planning.matching import ENUMERATE_UP_TO, bottleneck_matching
from shoal.planning.swarm import NodeId, StageIndex, Swarm

Parts = list[list[int]]  # node positions (in node-id order) per stage, each list sorted
Chains = list[list[int]]  # pipelines as positions: data node, then one node per block stage
Move = tuple[str, int, int]  # ("swap", node, node) or ("relabel", stage, stage)
Scored = tuple[float, Parts, Chains]

FULL_NEIGHBOURHOOD = 1000  # moves; up to this many, anneal and climb over every move, as DT-FM-sized swarms allow
CLIMB_WORK = 200_000  # beyond: the bottleneck climb evaluates at most CLIMB_WORK / nodes moves ...
CLIMB_EVALUATIONS = (60, 4000)  # ... clamped to this range (deterministic: a count, never a clock)
PARTNERS = 16  # swaps drawn per bottleneck node: half at its own site, half anywhere
_CACHE_CELLS = 4_000_000  # memo bound, in node positions held by its keys (a few tens of MB)


@dataclass(frozen=True)
class Allocation:
    """Which stage each node serves, the DT-FM cost of that choice, and its fixed pipelines."""

    stage_of: dict[NodeId, StageIndex]
    cost: float
    pipelines: tuple[tuple[NodeId, ...], ...]  # data node, then one node per block stage in order


def allocate_stages(
    swarm: Swarm,
    cost: CostModel,
    sizes: Sequence[int],
    rng: random.Random,
    restarts: int = 2,
    anneal_steps: int = 1500,
) -> Allocation:
    """Search for the allocation with the lowest DP_cost + 2 * PP_cost; sizes[s] nodes go to stage s.

    Where the whole neighbourhood is small (FULL_NEIGHBOURHOOD), each restart anneals from a random
    allocation (temperature from 5 % of its cost down to 0.05 %), then climbs to a local optimum;
    the best over restarts wins. Larger swarms climb once from the best banded start.
    """
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    if sum(sizes) != len(nodes) or len(sizes) != swarm.stages or min(sizes) < 1:
        raise ValueError(f"stage sizes {list(sizes)} do not fit {len(nodes)} nodes in {swarm.stages} stages")
    links = LinkTable.build(swarm, cost, nodes)
    memo = _Memo()

    def score(parts: Parts) -> tuple[float, Chains]:
        return _objective(parts, links, memo)

    if _neighbourhood(sizes) <= FULL_NEIGHBOURHOOD:
        best = min((_anneal_and_climb(sizes, score, rng, anneal_steps) for _ in range(max(1, restarts))), key=_value)
    else:
        strength, starts = links.mean_transfer_s(), []
        for order in _stage_orders(len(sizes)):
            parts = banded_start(links, sizes, order, strength)
            value, chains = score(parts)
            starts.append((value, parts, chains))
        value, parts, chains = min(starts, key=_value)
        budget = min(max(CLIMB_WORK // len(nodes), CLIMB_EVALUATIONS[0]), CLIMB_EVALUATIONS[1])
        best = _climb_bottlenecks(value, parts, chains, score, links, rng, budget)
    value, parts, chains = best
    ids = [n.node_id for n in nodes]
    stage_of = {ids[i]: s for s, part in enumerate(parts) for i in part}
    return Allocation(stage_of, value, tuple(tuple(ids[i] for i in c) for c in chains))


def _value(scored: Scored) -> float:
    return scored[0]


def _neighbourhood(sizes: Sequence[int]) -> int:
    """Swaps of two nodes in different stages plus relabellings of two equal block stages."""
    swaps = (sum(sizes) ** 2 - sum(k * k for k in sizes)) // 2
    relabels = sum(1 for s in range(1, len(sizes)) for t in range(s + 1, len(sizes)) if sizes[s] == sizes[t])
    return swaps + relabels


def _anneal_and_climb(
    sizes: Sequence[int], score: Callable[[Parts], tuple[float, Chains]], rng: random.Random, steps: int
) -> Scored:
    """One restart: anneal from a random allocation, then climb from the best allocation seen."""
    order = list(range(sum(sizes)))
    rng.shuffle(order)
    parts, at = [], 0
    for size in sizes:
        parts.append(sorted(order[at : at + size]))
        at += size
    value, chains = score(parts)
    top = (value, parts, chains)
    t0 = 0.05 * value
    for step in range(steps):
        temperature = t0 * (1e-2 ** (step / steps))
        trial = _apply(parts, _random_move(parts, rng))
        trial_value, trial_chains = score(trial)
        delta = trial_value - value
        if delta < 0 or rng.random() < math.exp(-delta / max(temperature, 1e-12)):
            parts, value, chains = trial, trial_value, trial_chains
            if value < top[0] - 1e-12:
                top = (value, parts, chains)
    value, parts, chains = top
    improved = True
    while improved:
        improved = False
        for move in _moves(parts, rng):
            trial = _apply(parts, move)
            trial_value, trial_chains = score(trial)
            if trial_value < value - 1e-12:
                parts, value, chains, improved = trial, trial_value, trial_chains, True
    return value, parts, chains


def _climb_bottlenecks(
    value: float,
    parts: Parts,
    chains: Chains,
    score: Callable[[Parts], tuple[float, Chains]],
    links: LinkTable,
    rng: random.Random,
    budget: int,
) -> Scored:
    """Climb over swaps that move a node off one of the objective's bottlenecks; return the best seen.

    Each node on a bottleneck (`_bottleneck_nodes`) is tried against PARTNERS nodes of other stages,
    half drawn from its own site (such a swap leaves every stage's sites as they were) and half from
    anywhere; the first swap that lowers the cost is taken. A pass that finds none takes its first
    swap that keeps the cost, provided neither node has moved sideways before: a bottleneck set by
    several weak nodes only drops once all of them have left, one swap at a time. Stops when a pass
    finds neither, or after `budget` evaluations.
    """
    n = len(links)
    by_site: dict[int, list[int]] = {}
    for i in range(n):
        by_site.setdefault(int(links.site[i]), []).append(i)
    best = (value, parts, chains)
    moved: set[int] = set()  # nodes moved sideways once, never again: the walk cannot cycle
    while budget > 0:
        stage_of = {i: s for s, part in enumerate(parts) for i in part}
        better = sideways = None
        for a in _bottleneck_nodes(parts, chains, links):
            neighbours = [b for b in by_site[int(links.site[a])] if stage_of[b] != stage_of[a]]
            near = rng.sample(neighbours, min(len(neighbours), PARTNERS // 2))
            anywhere = [b for b in rng.sample(range(n), min(n, PARTNERS - len(near))) if stage_of[b] != stage_of[a]]
            for b in near + anywhere:
                trial = _apply(parts, ("swap", a, b))
                trial_value, trial_chains = score(trial)
                budget -= 1
                if trial_value < value - 1e-12:
                    better = (trial_value, trial, trial_chains)
                elif sideways is None and trial_value <= value + 1e-12 and not {a, b} & moved:
                    sideways = (trial_value, trial, trial_chains), (a, b)
                if better is not None or budget <= 0:
                    break
            if better is not None or budget <= 0:
                break
        if better is not None:
            value, parts, chains = best = better
        elif sideways is not None:
            (value, parts, chains), pair = sideways
            moved.update(pair)
        else:
            break
    return best


def _bottleneck_nodes(parts: Parts, chains: Chains, links: LinkTable) -> list[int]:
    """The ends of the slowest link inside the slowest stage, of the slowest link between each pair of
    consecutive stages along the pipelines, and the three nodes of the slowest closing (data node,
    first and last block node), without repeats, in that order."""
    _, a, b = max(links.slowest_pair(part) for part in parts)
    out = [a, b] if a >= 0 else []
    pipes = np.asarray(chains, dtype=np.intp)  # (pipelines, stages)
    for k in range(1, pipes.shape[1] - 1):
        slowest = int(links.pairwise(pipes[:, k], pipes[:, k + 1]).argmax())
        out += [int(pipes[slowest, k]), int(pipes[slowest, k + 1])]
    closing = links.pairwise(pipes[:, 0], pipes[:, 1]) + links.pairwise(pipes[:, -1], pipes[:, 0])
    slowest = int(closing.argmax())
    out += [int(pipes[slowest, 0]), int(pipes[slowest, 1]), int(pipes[slowest, -1])]
    return list(dict.fromkeys(out))


def _stage_orders(stages: int) -> list[list[int]]:
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


def _random_move(parts: Parts, rng: random.Random) -> Move:
    same_size = [
        (s, t) for s in range(1, len(parts)) for t in range(s + 1, len(parts)) if len(parts[s]) == len(parts[t])
    ]
    if same_size and rng.random() < 0.1:
        return ("relabel", *rng.choice(same_size))
    s, t = rng.sample(range(len(parts)), 2)
    return ("swap", rng.choice(parts[s]), rng.choice(parts[t]))


def _moves(parts: Parts, rng: random.Random) -> list[Move]:
    """Every swap of two nodes in different stages and every relabelling of two equal block stages, shuffled."""
    stage_of = {i: s for s, part in enumerate(parts) for i in part}
    everyone = sorted(stage_of)
    moves = [("swap", a, b) for k, a in enumerate(everyone) for b in everyone[k + 1 :] if stage_of[a] != stage_of[b]]
    moves += [
        ("relabel", s, t)
        for s in range(1, len(parts))
        for t in range(s + 1, len(parts))
        if len(parts[s]) == len(parts[t])
    ]
    rng.shuffle(moves)
    return moves


def _apply(parts: Parts, move: Move) -> Parts:
    kind, a, b = move
    out = list(parts)
    if kind == "relabel":
        out[a], out[b] = out[b], out[a]
        return out
    sa = next(s for s, p in enumerate(out) if a in p)
    sb = next(s for s, p in enumerate(out) if b in p)
    out[sa] = sorted([b if i == a else i for i in out[sa]])
    out[sb] = sorted([a if i == b else i for i in out[sb]])
    return out


class _Memo:
    """The objective's terms by their inputs (stage members, chain ends), so a move that changes two
    stages recomputes only the terms it touches. Forgotten wholesale once its keys hold `limit`
    node positions, which bounds memory at any swarm size."""

    def __init__(self, limit: int = _CACHE_CELLS) -> None:
        self.values: dict[tuple, object] = {}
        self.cells, self.limit = 0, limit

    def get(self, key: tuple, compute: Callable[[], object]):
        value = self.values.get(key)
        if value is None:
            size = sum(len(part) for part in key[1:])
            if self.cells + size > self.limit:
                self.values.clear()
                self.cells = 0
            value = self.values[key] = compute()
            self.cells += size
        return value


def _objective(parts: Parts, links: LinkTable, memo: _Memo | None = None) -> tuple[float, list[list[int]]]:
    """DP_cost + 2 * PP_cost of a partition, and the pipelines its matchings chain together."""
    memo = _Memo() if memo is None else memo
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
    memo: _Memo,
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
    parts: Sequence[Sequence[int]], links: LinkTable, memo: _Memo | None = None
) -> tuple[float, list[list[int]]]:
    """Chain stage 1 .. S-1 by successive bottleneck matchings, then match each chain to a data node.

    Returns (PP_cost, chains as [data node, stage-1 node, ...]), nodes as positions in `links`.
    There are as many chains as the smallest stage has nodes.
    """
    memo = _Memo() if memo is None else memo
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
