"""Node-to-stage allocation by DT-FM's objective (`dtfm_objective.py`), as SkipPipe's phase A.

The authors search with a genetic algorithm. Ours depends on the swarm's size. Where every swap of
two nodes can be tried (the paper's 20 nodes have 175 moves), it is seeded simulated annealing with
restarts (move one pair of nodes between stages, or relabel two whole block stages), then a climb
to a local optimum over every move. Beyond, it starts from same-site pipelines banded by strength
(`banded_start.py`, the best of a few stage orders) and climbs over swaps of the nodes on the
objective's bottlenecks, for a bounded number of evaluations. Either way the objective is memoised
per stage and per pair of stages, so a move recomputes only the terms it touches.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.planning.banded_start import banded_start, stage_orders
from shoal.planning.costs import CostModel
from shoal.planning.dtfm_objective import Chains, Memo, Parts, objective
from shoal.planning.links import LinkTable
from shoal.planning.swarm import NodeId, StageIndex, Swarm

Move = tuple[str, int, int]  # ("swap", node, node) or ("relabel", stage, stage)
Scored = tuple[float, Parts, Chains]

FULL_NEIGHBOURHOOD = 1000  # moves; up to this many, anneal and climb over every move, as DT-FM-sized swarms allow
CLIMB_WORK = 200_000  # beyond: the bottleneck climb evaluates at most CLIMB_WORK / nodes moves ...
CLIMB_EVALUATIONS = (60, 4000)  # ... clamped to this range (deterministic: a count, never a clock)
PARTNERS = 16  # swaps drawn per bottleneck node: half at its own site, half anywhere


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
    memo = Memo()

    def score(parts: Parts) -> tuple[float, Chains]:
        return objective(parts, links, memo)

    if _neighbourhood(sizes) <= FULL_NEIGHBOURHOOD:
        best = min((_anneal_and_climb(sizes, score, rng, anneal_steps) for _ in range(max(1, restarts))), key=_value)
    else:
        strength, starts = links.mean_transfer_s(), []
        for order in stage_orders(len(sizes)):
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
