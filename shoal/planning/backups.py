"""Which node keeps a copy of which stage, so that a stage that loses every replica comes back as it
was (shoal/node/stage/kept_copies.py does the keeping): pure rules over the run's shape."""

from __future__ import annotations

import math
from collections.abc import Callable

CHANGE_BYTES_PER_VALUE = 1 + 4 / 64  # a snapshot's change: int8 values, a float32 scale per 64
KEPT_CHANGES = 2  # a replica keeps its last changes, for keepers a snapshot or two behind


def keeps_edge_copy(rule: str, stages: int, stage: int) -> bool:
    """Whether a worker of `stage` keeps a copy of stage 0: under CheckFree+, stage 0's neighbours."""
    return rule == "checkfree_plus" and stage in (1, stages - 1)


def backed_up_stage(stages: int, stage: int) -> int | None:
    """The block stage whose backup a worker of block stage `stage` keeps: the one before it, the
    first block stage keeping the last (None where the run has a single block stage)."""
    if stages < 3 or not 1 <= stage < stages:
        return None
    return stage - 1 if stage > 1 else stages - 1


def backup_keepers(stages: int, stage: int) -> list[int]:
    """The block stages whose workers keep a backup of `stage`."""
    return [s for s in range(1, stages) if backed_up_stage(stages, s) == stage]


def held_values(stages: int, stage: int, params_of: Callable[[int], int], rule: str, backups: bool) -> int:
    """float32 values a worker of `stage` holds on the host for the copies it keeps: CheckFree+'s stage 0
    (θ and φ), the snapshot of the block stage it backs up, and its own stage's latest snapshot with the
    last int8 changes that led to it (shoal/train/backup_stream.py)."""
    held = 2 * params_of(0) if keeps_edge_copy(rule, stages, stage) else 0
    backed_up = backed_up_stage(stages, stage) if backups else None
    if backed_up is not None:
        held += params_of(backed_up)
    if backups and backup_keepers(stages, stage):
        held += math.ceil(params_of(stage) * (1 + KEPT_CHANGES * CHANGE_BYTES_PER_VALUE / 4))
    return held
