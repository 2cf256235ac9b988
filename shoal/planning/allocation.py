"""Node-to-stage allocation by DT-FM's objective (Yuan et al., NeurIPS 2022), as SkipPipe's phase A.

DT-FM minimises DP_cost + 2 * PP_cost: DP_cost is the slowest link inside any stage (its replicas
all-reduce), PP_cost sums, over consecutive stages, the bottleneck of a matching between their
nodes; the matched nodes form its fixed pipelines. The authors search with a genetic algorithm;
we use seeded simulated annealing with restarts (move one pair of nodes between stages, or relabel
two whole block stages) over the same objective, which the issue allows and which finishes in well
under a second at the paper's 20 nodes.

Two choices are ours and stated: a link's weight is the transfer time of one activation (the
authors' scheduler also builds both costs from one delay matrix), and, because a microbatch's
loss lives on its data node, the closing hop back to the data node is part of PP_cost.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.planning.costs import CostModel
from shoal.planning.matching import bottleneck_matching
from shoal.planning.swarm import NodeId, StageIndex, Swarm


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

    Each restart anneals from a random allocation (temperature from 5 % of its cost down to 0.05 %),
    then climbs to a local optimum; the best over restarts wins.
    """
    nodes = sorted(swarm.nodes, key=lambda n: n.node_id)
    if sum(sizes) != len(nodes) or len(sizes) != swarm.stages or min(sizes) < 1:
        raise ValueError(f"stage sizes {list(sizes)} do not fit {len(nodes)} nodes in {swarm.stages} stages")
    delay = [[cost.transfer_s(swarm, a, b) for b in nodes] for a in nodes]
    ids = [n.node_id for n in nodes]
    best: tuple[float, list[list[int]], list[list[int]]] | None = None
    cache: dict = {}
    for _ in range(max(1, restarts)):
        order = list(range(len(nodes)))
        rng.shuffle(order)
        parts, at = [], 0
        for size in sizes:
            parts.append(sorted(order[at : at + size]))
            at += size
        value, chains = _objective(parts, delay, cache)
        top = (value, parts, chains)
        t0 = 0.05 * value
        for step in range(anneal_steps):
            temperature = t0 * (1e-2 ** (step / anneal_steps))
            trial = _apply(parts, _random_move(parts, rng))
            trial_value, trial_chains = _objective(trial, delay, cache)
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
                trial_value, trial_chains = _objective(trial, delay, cache)
                if trial_value < value - 1e-12:
                    parts, value, chains, improved = trial, trial_value, trial_chains, True
        if best is None or value < best[0]:
            best = (value, parts, chains)
    assert best is not None
    value, parts, chains = best
    stage_of = {ids[i]: s for s, part in enumerate(parts) for i in part}
    return Allocation(stage_of, value, tuple(tuple(ids[i] for i in c) for c in chains))


def _random_move(parts: list[list[int]], rng: random.Random) -> tuple[str, int, int]:
    same_size = [
        (s, t) for s in range(1, len(parts)) for t in range(s + 1, len(parts)) if len(parts[s]) == len(parts[t])
    ]
    if same_size and rng.random() < 0.1:
        return ("relabel", *rng.choice(same_size))
    s, t = rng.sample(range(len(parts)), 2)
    return ("swap", rng.choice(parts[s]), rng.choice(parts[t]))


def _moves(parts: list[list[int]], rng: random.Random) -> list[tuple[str, int, int]]:
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


def _apply(parts: list[list[int]], move: tuple[str, int, int]) -> list[list[int]]:
    kind, a, b = move
    out = [list(p) for p in parts]
    if kind == "relabel":
        out[a], out[b] = out[b], out[a]
        return out
    sa = next(s for s, p in enumerate(out) if a in p)
    sb = next(s for s, p in enumerate(out) if b in p)
    out[sa][out[sa].index(a)] = b
    out[sb][out[sb].index(b)] = a
    return [sorted(p) for p in out]


def _objective(
    parts: list[list[int]], delay: list[list[float]], cache: dict | None = None
) -> tuple[float, list[list[int]]]:
    """DP_cost + 2 * PP_cost of a partition, and the pipelines its matchings chain together."""
    cache = {} if cache is None else cache
    dp = 0.0
    for part in parts:
        key = ("dp", tuple(part))
        if key not in cache:
            cache[key] = max((delay[a][b] for a in part for b in part if a != b), default=0.0)
        dp = max(dp, cache[key])
    pp, chains = pipeline_chains(parts, delay, cache)
    return dp + 2.0 * pp, chains


def _matching(weights_of, rows: tuple[int, ...], cols: tuple[int, ...], cache: dict) -> tuple[float, tuple[int, ...]]:
    """Cached bottleneck matching of `rows` into `cols` under the weight function `weights_of`."""
    key = (weights_of.__name__, rows, cols)
    if key not in cache:
        cache[key] = bottleneck_matching([[weights_of(r, c) for c in cols] for r in rows])
    return cache[key]


def pipeline_chains(
    parts: list[list[int]], delay: list[list[float]], cache: dict | None = None
) -> tuple[float, list[list[int]]]:
    """Chain stage 1 .. S-1 by successive bottleneck matchings, then match each chain to a data node.

    Returns (PP_cost, chains as [data node, stage-1 node, ...]). There are as many chains as the
    smallest stage has nodes.
    """
    cache = {} if cache is None else cache

    def link(a: int, b: int) -> float:
        return delay[a][b]

    def link_back(b: int, a: int) -> float:
        return delay[a][b]

    chains = [[i] for i in parts[1]]
    pp = 0.0
    for part in parts[2:]:
        ends = tuple(c[-1] for c in chains)
        if len(ends) <= len(part):
            value, cols = _matching(link, ends, tuple(part), cache)
            chains = [c + [part[col]] for c, col in zip(chains, cols, strict=True)]
        else:  # fewer nodes here than chains: keep the chains the matching picks
            value, cols = _matching(link_back, tuple(part), ends, cache)
            chains = [chains[col] + [j] for j, col in zip(part, cols, strict=True)]
        pp += value
    data = tuple(parts[0])
    pairs = tuple((c[0], c[-1]) for c in chains)
    key = ("closing", pairs, data)
    if key not in cache:
        closing = [[delay[d][first] + delay[last][d] for d in data] for first, last in pairs]
        if len(pairs) <= len(data):
            cache[key] = bottleneck_matching(closing)
        else:
            cache[key] = bottleneck_matching([[closing[k][d] for k in range(len(pairs))] for d in range(len(data))])
    value, cols = cache[key]
    if len(pairs) <= len(data):
        chains = [[data[col]] + c for c, col in zip(chains, cols, strict=True)]
    else:
        chains = [[data[d]] + chains[col] for d, col in enumerate(cols)]
    return pp + value, chains
