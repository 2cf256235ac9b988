"""Who keeps a backup of which block stage (shoal/planning/backups.py), and what it costs in memory."""

from __future__ import annotations

import math

from shoal.node.capacity import stage_need
from shoal.planning.backups import (
    CHANGE_BYTES_PER_VALUE,
    KEPT_CHANGES,
    backed_up_stage,
    backup_keepers,
    keeps_edge_copy,
)
from tests.helpers.tiny import tiny_run


def test_every_block_stage_has_one_keeper_of_another_stage_and_a_single_block_stage_none() -> None:
    for stages in range(3, 12):
        for stage in range(1, stages):
            keepers = backup_keepers(stages, stage)
            assert len(keepers) == 1 and keepers[0] != stage and 1 <= keepers[0] < stages
        assert backed_up_stage(stages, 0) is None  # data nodes keep no backup
    assert backup_keepers(2, 1) == [] and backed_up_stage(2, 1) is None
    assert [backed_up_stage(4, s) for s in (1, 2, 3)] == [3, 1, 2]
    assert keeps_edge_copy("checkfree_plus", 4, 1) and keeps_edge_copy("checkfree_plus", 4, 3)
    assert not keeps_edge_copy("checkfree_plus", 4, 2) and not keeps_edge_copy("checkfree", 4, 1)


def test_a_workers_memory_plan_counts_the_backup_it_keeps() -> None:
    run = tiny_run(**{"pipeline.stages": 4, "model.n_layers": 3})
    off = tiny_run(**{"pipeline.stages": 4, "model.n_layers": 3, "repair.backup_every": 0})
    kept = stage_need(run, 2).fixed - stage_need(off, 2).fixed
    neighbour, own = stage_need(off, 1).params, stage_need(off, 2).params
    # stage 1's snapshot, and our own stage's snapshot with its last two int8 changes, all on the host
    assert kept == 4 * neighbour + 4 * math.ceil(own * (1 + KEPT_CHANGES * CHANGE_BYTES_PER_VALUE / 4))
    assert stage_need(run, 0).fixed == stage_need(off, 0).fixed
