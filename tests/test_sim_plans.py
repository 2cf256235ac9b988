"""The simulator executes a collision-aware plan exactly as planned, and survives noise around it."""

from __future__ import annotations

import pytest

from shoal.sim.run import RunSpec, simulate


def test_a_collision_aware_plan_is_realised_exactly_at_the_papers_setting():
    result = simulate(RunSpec(scenario="gcp12", policy="skippipe", allocation="given"))
    assert result.completed == 30
    assert result.makespan_s == pytest.approx(result.predicted_makespan_s)
    assert result.collision_s == pytest.approx(0.0) and result.memory_wait_s == pytest.approx(0.0)


def test_without_collision_avoidance_microbatches_queue_on_busy_nodes():
    result = simulate(RunSpec(scenario="gcp12", policy="skippipe", allocation="given", collision_aware=False))
    assert result.completed == 30 and result.predicted_makespan_s is None
    assert result.collision_s > 0


def test_compute_jitter_perturbs_a_plan_without_losing_work():
    exact = simulate(RunSpec(scenario="gcp12", policy="skippipe", allocation="given"))
    noisy = simulate(RunSpec(scenario="gcp12", policy="skippipe", allocation="given", jitter=0.2, seed=0))
    assert noisy.completed == 30
    assert noisy.makespan_s != pytest.approx(exact.makespan_s)
