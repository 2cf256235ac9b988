"""Under churn no microbatch is lost silently: every one injected ends completed or abandoned with a reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import cache

import pytest

from shoal.sim.run import RunSpec, simulate

HIGH = 30.0  # crash + leave events per node per hour: dozens in a run of a few hundred seconds


@cache
def _continuous_runs(policy: str):
    return tuple(
        simulate(RunSpec(scenario="random", policy=policy, nodes=24, stages=5, microbatches=60, churn=HIGH, seed=s))
        for s in range(3)
    )


@pytest.mark.parametrize("policy", ["swarm", "gwtf", "random"])
def test_continuous_policies_account_for_every_microbatch(policy):
    landed = Counter()
    for result in _continuous_runs(policy):
        assert result.completed + result.abandoned == result.injected
        assert sum(result.abandoned_reasons.values()) == result.abandoned
        assert not any("stalled" in reason for reason in result.abandoned_reasons)
        assert result.completed == 60, "the run goes on until N microbatches have completed"
        landed.update(result.churn)
    assert landed["crashes"] > 10 and landed["leaves"] > 0 and landed["joins"] > 0
    assert landed["crash_mid_forward"] > 0 and landed["crash_mid_backward"] > 0


@pytest.mark.parametrize("policy", ["dtfm", "skippipe"])
def test_static_plans_account_for_every_microbatch_under_churn(policy):
    for seed in range(3):
        spec = RunSpec(policy=policy, churn=HIGH * 3, seed=seed, allocation="given")
        result = simulate(spec)
        assert result.injected == 30
        assert result.completed + result.abandoned == 30
        assert sum(result.abandoned_reasons.values()) == result.abandoned
        assert not any("stalled" in reason for reason in result.abandoned_reasons)


def test_every_policy_redoes_only_lost_hops_and_restarts_only_when_the_gradient_is_gone_too():
    for policy in ("swarm", "gwtf", "random"):
        runs = _continuous_runs(policy)
        recomputed, restarted = sum(r.recomputed_hops for r in runs), sum(r.restarted for r in runs)
        assert recomputed > 0, f"{policy} redoes lost hops"
        assert restarted < recomputed, f"{policy} restarts a microbatch only when its re-sendable gradient died too"
        assert all(r.wasted_compute_s > 0 for r in runs), "work lost to a crash is counted as wasted"


@pytest.mark.parametrize("policy", ["swarm", "gwtf"])
def test_churn_takes_block_stage_nodes_only_unless_asked_to_take_data_nodes(policy):
    for result in _continuous_runs(policy):
        assert "data node crashed" not in result.abandoned_reasons, "churn left every data node alone"
    spec = RunSpec(scenario="random", policy=policy, nodes=24, stages=5, microbatches=60, churn=HIGH, seed=0)
    drained = simulate(replace(spec, churn_data_nodes=True))
    assert drained.abandoned_reasons.get("data node crashed", 0) > 0
    assert drained.completed + drained.abandoned == drained.injected
