"""Failure schedules for stage-repair experiments, and what a schedule costs a checkpointing run.

papers/checkfree.md gives failure rates per stage per hour (5 %, 10 %, 16 %). An hour of training is
3600 / t_iter iterations, so the chance that a stage fails during one iteration is
p = 1 - (1 - p_h)^(t_iter / 3600) (the conversion the authors' code has commented out; they
hard-coded per-iteration values instead). A schedule is a list of `Failure`s in iteration *slots*:
slot i is the i-th iteration of wall-clock time, whatever it trains. A run that rebuilds lost stages
trains step i in slot i; a run that rolls back to a checkpoint spends some slots training steps
again, so the same schedule costs the two differently (`checkpoint_timeline`).

Everything here is pure and seeded: the same arguments always give the same schedule.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, order=True)
class Failure:
    slot: int  # the iteration at whose start the stage is lost (before its forward passes)
    stage: int


def step_probability(rate_per_hour: float, t_iter_s: float) -> float:
    """The chance that one stage fails during one iteration of `t_iter_s` seconds."""
    if not 0.0 <= rate_per_hour <= 1.0:
        raise ValueError(f"a failure rate per hour is a probability, got {rate_per_hour}")
    if t_iter_s <= 0:
        raise ValueError(f"t_iter_s must be positive, got {t_iter_s}")
    return 1.0 - (1.0 - rate_per_hour) ** (t_iter_s / SECONDS_PER_HOUR)


def rate_failures(
    rate_per_hour: float, t_iter_s: float, stages: Sequence[int], slots: int, seed: int, scale: float = 1.0
) -> list[Failure]:
    """Independent failures of each stage in each of `slots` slots at `scale` x the per-slot chance.

    Draws go slot by slot, stage by stage, so a longer horizon extends the same schedule. Several
    stages, neighbours included, can fail in one slot, as in the authors' simulation."""
    if scale < 0:
        raise ValueError(f"scale must be non-negative, got {scale}")
    p = min(1.0, scale * step_probability(rate_per_hour, t_iter_s))
    rng = random.Random(f"failures:{seed}:{rate_per_hour}")
    return [Failure(slot, stage) for slot in range(slots) for stage in stages if rng.random() < p]


def single_wipes(wipes: Iterable[tuple[int, int]]) -> list[Failure]:
    """A fixed schedule from (slot, stage) pairs."""
    return sorted(Failure(slot, stage) for slot, stage in wipes)


def by_slot(failures: Iterable[Failure]) -> dict[int, list[int]]:
    """The stages lost at each slot that loses any, in stage order."""
    out: dict[int, list[int]] = {}
    for failure in sorted(failures):
        out.setdefault(failure.slot, []).append(failure.stage)
    return out


@dataclass(frozen=True)
class CheckpointRun:
    """A checkpointing run's path to `progress` steps under a schedule."""

    slots: int  # iterations spent, replayed ones included
    progress: int  # training steps reached (== the target unless `max_slots` ran out)
    failures: int  # stages lost on the way
    rollbacks: int  # slots that lost any stage: each reloads the whole model once
    lost_steps: int  # steps trained again after roll-backs
    saves: int  # checkpoints written (the initial weights are not counted: they need no save)


def checkpoint_timeline(failures: Iterable[Failure], interval: int, target: int, max_slots: int) -> CheckpointRun:
    """Train until `target` steps, saving every `interval` steps; a failure at the start of a slot
    rolls the whole model back to the last checkpoint (the initial weights before the first), and the
    slot trains the step after it. Several stages lost in one slot cost one roll-back."""
    if interval < 1:
        raise ValueError(f"interval must be at least 1, got {interval}")
    lost_at = by_slot(failures)
    progress = last = slot = lost = saves = rollbacks = failed = 0
    while progress < target and slot < max_slots:
        if slot in lost_at:
            failed += len(lost_at[slot])
            rollbacks += 1
            lost += progress - last
            progress = last
        progress += 1
        slot += 1
        if progress % interval == 0 and progress > last:
            last = progress
            saves += 1
    return CheckpointRun(
        slots=slot, progress=progress, failures=failed, rollbacks=rollbacks, lost_steps=lost, saves=saves
    )
