"""Failure schedules (papers/checkfree.md's rates per stage per hour) and the checkpoint timeline."""

from __future__ import annotations

import pytest

from shoal.train.failures import (
    Failure,
    by_slot,
    checkpoint_timeline,
    rate_failures,
    single_wipes,
    step_probability,
)


def test_an_hourly_rate_becomes_a_per_iteration_chance():
    # the paper's 500M iteration (91.35 s): 5 %/h -> 1 - 0.95^(91.35/3600)
    assert step_probability(0.05, 91.35) == pytest.approx(1 - 0.95 ** (91.35 / 3600))
    assert step_probability(0.05, 91.35) == pytest.approx(0.0013, abs=1e-4)
    assert step_probability(0.16, 3600.0) == pytest.approx(0.16)  # one-hour iterations: the rate itself
    assert step_probability(0.0, 91.35) == 0.0
    with pytest.raises(ValueError, match="probability"):
        step_probability(5.0, 91.35)


def test_rate_schedules_are_seeded_and_a_longer_horizon_extends_the_same_draws():
    a = rate_failures(0.16, 91.35, stages=range(1, 7), slots=2000, seed=3, scale=4.0)
    assert a == rate_failures(0.16, 91.35, stages=range(1, 7), slots=2000, seed=3, scale=4.0)
    assert a != rate_failures(0.16, 91.35, stages=range(1, 7), slots=2000, seed=4, scale=4.0)
    longer = rate_failures(0.16, 91.35, stages=range(1, 7), slots=4000, seed=3, scale=4.0)
    assert longer[: len(a)] == a and all(f.slot < 2000 for f in a)
    assert all(1 <= f.stage <= 6 for f in longer)
    expected = 4000 * 6 * 4.0 * step_probability(0.16, 91.35)  # ~ 96
    assert 0.6 * expected < len(longer) < 1.4 * expected
    assert rate_failures(0.16, 91.35, range(1, 7), 2000, seed=3, scale=0.0) == []


def test_single_wipes_and_grouping_by_slot():
    schedule = single_wipes([(200, 4), (100, 3), (200, 2)])
    assert schedule == [Failure(100, 3), Failure(200, 2), Failure(200, 4)]
    assert by_slot(schedule) == {100: [3], 200: [2, 4]}


def test_checkpointing_replays_the_steps_since_the_last_save():
    # saves at 10, 20, ...; a failure at slot 25 rolls back to 20 (5 steps lost); two stages lost
    # at slot 40 are one roll-back: progress there is 35 (slots 25..39 trained 20..34), back to 30.
    run = checkpoint_timeline(single_wipes([(25, 3), (40, 2), (40, 3)]), interval=10, target=50, max_slots=1000)
    assert (run.lost_steps, run.failures, run.rollbacks) == (10, 3, 2)
    assert run.slots == 50 + 10 and run.progress == 50
    assert run.saves == 5  # 10, 20, 30, 40, 50: re-reaching 30 after the second roll-back saves nothing new


def test_a_failure_before_the_first_save_restarts_from_the_initial_weights():
    run = checkpoint_timeline([Failure(7, 1)], interval=100, target=20, max_slots=1000)
    assert (run.slots, run.lost_steps, run.saves) == (27, 7, 0)
    no_failures = checkpoint_timeline([], interval=1, target=20, max_slots=1000)
    assert (no_failures.slots, no_failures.lost_steps, no_failures.saves) == (20, 0, 20)


def test_a_schedule_that_never_lets_a_run_finish_stops_at_max_slots():
    every_slot = [Failure(s, 1) for s in range(100)]
    run = checkpoint_timeline(every_slot, interval=10, target=20, max_slots=100)
    assert run.slots == 100 and run.progress == 1 and run.rollbacks == 100
