"""Rebuilding a stage that nobody holds any more from its neighbours (CheckFree, CheckFree+).

papers/checkfree.md: an interior block stage s is rebuilt as the average of stages s-1 and s+1
weighted by their most recent gradient norms ω (a larger norm marks a less converged stage, which
gets more weight), then trained on with a fresh inner optimizer at 1.1x the learning rate. The first
and last block stages have only one block neighbour; CheckFree+ trains them to stand in for each
other by swapping them in a share of the microbatches, and rebuilds one by copying its swap partner.

ω is the *unclipped* norm by default: with per-stage clipping at 1, two neighbours whose norms both
exceed 1 would get equal weights and the rule would silently degrade to a plain average. Both norms
are published, and `weights_from="clipped"` follows the authors' code for comparison.

Everything here is a function over plain data (lists of tensors, stage numbers): the daemon, the
demo and the benchmark call the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shoal.config import RunConfig
from shoal.model.llama import derive_seed
from shoal.model.stages import build_stage

Tensors = Sequence[torch.Tensor]

NORM_EPSILON = 1e-4  # added to each ω, as in the authors' code, so that zero norms still average
REPAIR_LR_SCALE = 1.1


@dataclass(frozen=True)
class Neighbour:
    """What a lost stage's neighbour gives: its stage, weights, and last gradient norms."""

    stage: int
    weights: Tensors
    grad_norm: float  # unclipped L2 norm of the stage's last gradient
    grad_norm_clipped: float  # the same after clipping (what the authors' code weighs by)
    inner_step: int = 0


@dataclass(frozen=True)
class RepairPlan:
    """Which rule rebuilds a stage, from which stages, and why (said in the log and the record)."""

    stage: int
    rule: str  # checkfree, copy_partner, copy, uniform or random
    sources: tuple[int, ...]
    note: str = ""


@dataclass(frozen=True)
class Repaired:
    weights: list[torch.Tensor]
    rule: str
    sources: tuple[int, ...]
    mix: tuple[float, ...] = field(default=())  # the normalised weight of each source
    note: str = ""


def block_stages(num_stages: int) -> range:
    """The block stages of a pipeline of `num_stages` stages (stage 0 is the embedding and head)."""
    return range(1, num_stages)


def swap_partner(stage: int, num_stages: int) -> int | None:
    """CheckFree+'s partner of an edge block stage (first <-> second, last <-> second to last)."""
    first, last = 1, num_stages - 1
    if last - first < 1:
        return None
    if stage == first:
        return first + 1
    if stage == last:
        return last - 1
    return None


def swap_pairs(num_stages: int) -> list[tuple[int, int]]:
    """The pairs CheckFree+ swaps: (1, 2) and (S-2, S-1), once each when they are the same or overlap."""
    first, last = 1, num_stages - 1
    if last - first < 1:
        return []
    pairs = [(first, first + 1)]
    if (last - 1, last) != pairs[0]:
        pairs.append((last - 1, last))
    return pairs


def swapped_order(order: Sequence[int], num_stages: int, variant: int) -> list[int]:
    """`order` (a route's block stages) with CheckFree+'s swaps applied. Disjoint pairs swap together;
    overlapping pairs (three block stages) take turns by `variant`, so both edges learn to stand in."""
    pairs = swap_pairs(num_stages)
    if len(pairs) == 2 and set(pairs[0]) & set(pairs[1]):
        pairs = [pairs[variant % 2]]
    swapped = list(order)
    for a, b in pairs:
        if a in swapped and b in swapped:
            i, j = swapped.index(a), swapped.index(b)
            swapped[i], swapped[j] = swapped[j], swapped[i]
    return swapped


def swap_variant(step: int, microbatch: int, per_step: int, share: float) -> int | None:
    """CheckFree+: whether microbatch `microbatch` of `step` runs with swap partners exchanged, and
    which `swapped_order` variant; None: the natural order. A `share` of the run's microbatches spread
    evenly (0.5: every other one, as the authors' code), and where the pairs overlap (three block
    stages) they take turns. A function of the microbatch's place alone, so a resend keeps its order
    and two runs under different repair rules swap the same microbatches."""
    index = step * per_step + microbatch
    before = math.floor(index * share)  # swaps among the microbatches before this one
    if share <= 0 or math.floor((index + 1) * share) <= before:
        return None
    return before


def plan_repair(stage: int, num_stages: int, available: set[int], rule: str) -> RepairPlan:
    """How to rebuild `stage` given the block stages that still have a live replica, by `rule`
    (`[repair] rule`: one planner each in `REPAIR_PLANNERS`).

    The paper covers an interior stage with both neighbours alive and (CheckFree+) an edge stage with
    its partner alive. Anything else falls back to the best rule still possible, and says so: one
    neighbour left -> copy it; none -> a fresh initialisation (the stage's training is lost)."""
    if rule not in REPAIR_PLANNERS:
        raise ValueError(f"unknown repair rule {rule!r} (known: {', '.join(REPAIR_PLANNERS)})")
    if stage not in block_stages(num_stages):
        raise ValueError(f"stage {stage} is not a block stage of a {num_stages}-stage pipeline")
    neighbours = [s for s in (stage - 1, stage + 1) if s in block_stages(num_stages)]
    lost = LostStage(stage, neighbours, [s for s in neighbours if s in available], swap_partner(stage, num_stages),
                     available)  # fmt: skip
    return REPAIR_PLANNERS[rule](lost)


@dataclass(frozen=True)
class LostStage:
    """What a planner sees of a lost block stage: its block neighbours, those alive, its swap partner."""

    stage: int
    neighbours: list[int]
    alive: list[int]
    partner: int | None
    available: set[int]


def _from_neighbours(mix: str) -> Callable[[LostStage], RepairPlan]:
    """Rebuild from both block neighbours by `mix` (checkfree, uniform, or copy the first); an edge
    stage copies its one block neighbour."""

    def plan(lost: LostStage) -> RepairPlan:
        if len(lost.neighbours) == 1 and lost.alive:
            return RepairPlan(lost.stage, "copy", tuple(lost.alive), note="edge stage: one block neighbour")
        if len(lost.alive) == 2:
            sources = (lost.alive[0],) if mix == "copy" else tuple(lost.alive)
            return RepairPlan(lost.stage, mix, sources)
        gone = [s for s in lost.neighbours if s not in lost.available]
        return _fallback(lost.stage, lost.alive, f"neighbour stage(s) {gone} lost too")

    return plan


def _checkfree_plus(lost: LostStage) -> RepairPlan:
    """An edge stage copies its swap partner, which CheckFree+ trained to stand in for it."""
    if lost.partner is None:
        return _from_neighbours("checkfree")(lost)
    if lost.partner in lost.available:
        return RepairPlan(lost.stage, "copy_partner", (lost.partner,))
    return _fallback(lost.stage, lost.alive, f"swap partner {lost.partner} is lost too")


# `[repair] rule` -> its planner (REPAIR_RULES in shoal/config.py names the same; a test holds them equal)
REPAIR_PLANNERS: dict[str, Callable[[LostStage], RepairPlan]] = {
    "checkfree": _from_neighbours("checkfree"),
    "checkfree_plus": _checkfree_plus,
    "uniform": _from_neighbours("uniform"),
    "copy": _from_neighbours("copy"),
    "random": lambda lost: RepairPlan(lost.stage, "random", ()),
}


def _fallback(stage: int, alive: list[int], why: str) -> RepairPlan:
    if alive:
        return RepairPlan(stage, "copy", (alive[0],), note=f"{why}: copying stage {alive[0]}")
    return RepairPlan(stage, "random", (), note=f"{why}: no neighbour left, fresh initialisation")


def neighbour_weights(neighbours: Sequence[Neighbour], weights_from: str = "unclipped") -> list[float]:
    """The normalised ω of each neighbour (ω = norm + NORM_EPSILON; a missing or non-finite norm
    counts as the mean of the others, or all equal if none is known)."""
    if weights_from not in ("unclipped", "clipped"):
        raise ValueError(f"weights_from must be unclipped or clipped, not {weights_from!r}")
    norms = [n.grad_norm if weights_from == "unclipped" else n.grad_norm_clipped for n in neighbours]
    known = [x for x in norms if x is not None and x == x and x >= 0 and x != float("inf")]
    fill = sum(known) / len(known) if known else 1.0
    omegas = [(x if x in known else fill) + NORM_EPSILON for x in norms]
    total = sum(omegas)
    return [w / total for w in omegas]


def fresh_weights(run: RunConfig, stage: int, slot: int) -> Tensors:
    """A random re-initialisation of `stage` for a repair whose stage first trains step `slot`: drawn
    from its own seed, not the run's (that would give back the stage's step-0 weights, which a short
    run with a large init has barely moved from, so 'random' would be nearly a restore)."""
    seed = derive_seed(run.train.seed, "repair", slot, stage)
    return [p.detach() for p in build_stage(run.model, run.pipeline.stages, stage, seed).parameters()]


def rebuild(
    plan: RepairPlan, neighbours: Sequence[Neighbour], fresh: Tensors, weights_from: str = "unclipped"
) -> Repaired:
    """The lost stage's weights by `plan`, from the neighbours that gave theirs (`fresh`: a seeded
    initialisation, for `random` and the shapes to check against). A neighbour whose tensors do not
    match the stage's shapes (stages of different depth) cannot stand in; the plan then degrades."""
    by_stage = {n.stage: n for n in neighbours if _same_shapes(n.weights, fresh)}
    usable = [by_stage[s] for s in plan.sources if s in by_stage]
    if plan.rule == "random" or not usable:
        note = plan.note or ("" if plan.rule == "random" else "no neighbour weights of the right shape")
        return Repaired([t.detach().clone() for t in fresh], "random", (), note=note)
    if plan.rule in ("copy", "copy_partner") or len(usable) == 1:
        source = usable[0]
        rule = plan.rule if len(usable) == len(plan.sources) else "copy"
        return Repaired([t.detach().clone() for t in source.weights], rule, (source.stage,), (1.0,), plan.note)
    if plan.rule == "uniform":
        mix = [1.0 / len(usable)] * len(usable)
    else:
        mix = neighbour_weights(usable, weights_from)
    weights = []
    for i, reference in enumerate(fresh):
        mixed = sum(w * n.weights[i].detach().to(torch.float32) for w, n in zip(mix, usable, strict=True))
        weights.append(mixed.to(reference.dtype))
    return Repaired(weights, plan.rule, tuple(n.stage for n in usable), tuple(mix), plan.note)


def _same_shapes(a: Tensors, b: Tensors) -> bool:
    return len(a) == len(b) and all(tuple(x.shape) == tuple(y.shape) for x, y in zip(a, b, strict=True))


def steps_to_recover(curve: Mapping[int, float], before: float, repaired_at: int) -> int | None:
    """Steps from the repair, whose rebuilt stage first trains step `repaired_at`, until a loss curve
    (step -> loss after it) is back under `before`, the pre-failure loss; None if not within the curve."""
    return next((s - repaired_at for s in sorted(curve) if s >= repaired_at and curve[s] < before), None)
