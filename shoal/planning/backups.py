"""Which node keeps a copy of which stage, so that a stage that loses every replica comes back as it
was (shoal/node/stage/kept_copies.py does the keeping): pure rules over the run's shape."""

from __future__ import annotations


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
