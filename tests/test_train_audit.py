"""Audits of stage replicas as pure decisions: honest drift passes, a garbage or scaled replica is blamed
by a majority, two replicas alone blame nobody, and refusals by averaging partners exclude only with two
accusers."""

from __future__ import annotations

import pytest
import torch

from shoal.adversary.stage import garbage_like, scaled
from shoal.train.audit import AuditConfig, StageSpread, excluded, judge, learn, measure, refused_by_partners

CONFIG = AuditConfig(tolerance=2.5, min_spread=0.5, window=8, failures=2)


def outputs(gen: torch.Generator, drift: float, n: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An input (B, T, C) and n honest replicas' outputs: a shared residual update plus each one's drift."""
    x = torch.randn(2, 8, 16, generator=gen)
    update = torch.randn(2, 8, 16, generator=gen)
    return x, {f"r{i}": x + update + drift * torch.randn(2, 8, 16, generator=gen) for i in range(n)}


def test_honest_replicas_pass_and_teach_the_spread():
    gen = torch.Generator().manual_seed(0)
    spread = StageSpread()
    for _ in range(6):
        x, ys = outputs(gen, drift=0.1, n=2)
        result = measure(x, ys)
        verdict = judge(result, spread, CONFIG, referee_available=True)
        assert verdict.passed and not verdict.blamed and not verdict.needs_referee
        spread = learn(spread, result, verdict, CONFIG)
    assert len(spread.deviations) == 6 and all(0 < d < 0.5 for d in spread.deviations)


@pytest.mark.parametrize("attack", ["garbage", "scaled"])
def test_two_disagree_a_referee_settles_it_and_the_odd_one_is_blamed(attack):
    gen = torch.Generator().manual_seed(1)
    spread = StageSpread((0.15,) * 8)
    x, ys = outputs(gen, drift=0.1)
    bad = garbage_like(ys["r0"], gen, 65504.0) if attack == "garbage" else scaled(ys["r0"], 20.0, 65504.0)
    pair = {"r0": bad, "r1": ys["r1"]}
    first = judge(measure(x, pair), spread, CONFIG, referee_available=True)
    assert not first.passed and first.needs_referee and not first.blamed
    assert not judge(measure(x, pair), spread, CONFIG, referee_available=False).blamed  # two alone: nobody
    result = measure(x, {**pair, "r2": ys["r2"]})
    verdict = judge(result, spread, CONFIG, referee_available=False)
    assert verdict.blamed == ("r0",) and not verdict.passed
    after = learn(spread, result, verdict, CONFIG)
    assert max(after.deviations) < 0.5  # only the agreeing majority taught the spread
    assert not excluded([True], CONFIG) and excluded([True, True], CONFIG) and excluded([True, False, True], CONFIG)
    assert not excluded([True, False, False, True], CONFIG)  # an honest replica's odd blames do not add up


def test_larger_honest_drift_than_usual_blames_nobody_when_the_majority_drifts_too():
    gen = torch.Generator().manual_seed(2)
    spread = StageSpread((0.05,) * 8)  # replicas were close; now, early in training, they are far apart
    x, ys = outputs(gen, drift=0.6)
    verdict = judge(measure(x, ys), spread, CONFIG, referee_available=False)
    assert verdict.passed and not verdict.blamed


def test_identical_outputs_do_not_shrink_the_spread():
    gen = torch.Generator().manual_seed(3)
    x, ys = outputs(gen, drift=0.0, n=2)  # two replicas that just averaged together
    result = measure(x, ys)
    verdict = judge(result, StageSpread(), CONFIG, referee_available=True)
    assert verdict.passed and learn(StageSpread(), result, verdict, CONFIG).deviations == ()


def test_a_hostile_majority_is_not_caught():
    """Replicas vote: two garbage replicas of three look like a stage whose replicas drifted apart."""
    gen = torch.Generator().manual_seed(4)
    x, ys = outputs(gen, drift=0.1)
    ys = {p: garbage_like(y, gen, 65504.0) if p != "r2" else y for p, y in ys.items()}
    assert not judge(measure(x, ys), StageSpread((0.15,) * 8), CONFIG, referee_available=False).blamed


def test_refusals_exclude_a_replica_only_with_two_accusers_and_a_majority():
    stage_of = {"a": 1, "b": 1, "c": 1, "d": 1, "z": 2}
    assert set(refused_by_partners({"b": {"a"}, "c": {"a"}, "d": {"a"}}, stage_of)) == {"a"}
    assert refused_by_partners({"b": {"a"}, "c": {"a"}}, stage_of) == {"a": refused_by_partners(
        {"b": {"a"}, "c": {"a"}}, stage_of)["a"]}  # fmt: skip
    assert refused_by_partners({"a": {"b", "c", "d"}}, stage_of) == {}  # one hostile accuser is not enough
    assert refused_by_partners({"b": {"a"}}, stage_of) == {}
    assert refused_by_partners({"b": {"a"}, "c": {"a"}}, stage_of, ignore={"c"}) == {}  # an excluded one's word
    assert refused_by_partners({"a": {"b"}, "b": {"a"}}, {"a": 1, "b": 1}) == {}  # two alone never exclude
    assert refused_by_partners({"b": {"z"}, "c": {"z"}}, stage_of) == {}  # only replicas of its own stage count


def test_twins_count_as_one_witness_and_blame_nobody():
    """Two replicas that just took each other as NoLoCo partners give identical outputs; a third one,
    left out of the pairs, is honestly far from both: one pair of weights is not a majority."""
    gen = torch.Generator().manual_seed(5)
    x, ys = outputs(gen, drift=1.0, n=2)
    ys["r2"] = ys["r0"].clone()  # r0 and r2 averaged together
    result = measure(x, ys)
    assert result.witnesses == 2
    assert result.deviations[0] == result.deviations[2] == result.deviations[1] > 0.5  # twins: distance to r1
    verdict = judge(result, StageSpread(), CONFIG, referee_available=False)
    assert not verdict.blamed
    assert learn(StageSpread(), result, verdict, CONFIG) == StageSpread()  # nothing learnt from it either
    x, ys = outputs(gen, drift=0.1, n=2)  # twins beside two distinct witnesses: a majority can blame again
    ys["r2"], ys["r3"] = ys["r0"].clone(), garbage_like(ys["r0"], gen, 65504.0)
    result = measure(x, ys)
    assert result.witnesses == 3
    assert judge(result, StageSpread((0.15,) * 8), CONFIG, referee_available=False).blamed == ("r3",)
