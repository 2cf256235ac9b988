"""The stage repair rules (papers/checkfree.md) on hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from shoal.config import ConfigError, RunConfig
from shoal.model.stages import build_stage
from shoal.train.repair import (
    NORM_EPSILON,
    Neighbour,
    fresh_weights,
    neighbour_weights,
    plan_repair,
    rebuild,
    steps_to_recover,
    swap_partner,
    swap_variant,
    swapped_order,
)
from tests.helpers.tiny import tiny_run


def _stage(value: float, norm: float, stage: int, clipped: float | None = None) -> Neighbour:
    weights = [torch.full((2, 3), value), torch.full((3,), value)]
    return Neighbour(stage, weights, norm, min(norm, 1.0) if clipped is None else clipped)


FRESH = [torch.zeros(2, 3), torch.zeros(3)]


def test_an_interior_stage_is_the_gradient_weighted_average_of_its_neighbours():
    plan = plan_repair(2, 5, available={1, 3, 4}, rule="checkfree")
    assert (plan.rule, plan.sources) == ("checkfree", (1, 3))
    repaired = rebuild(plan, [_stage(1.0, 3.0, 1), _stage(5.0, 1.0, 3)], FRESH)
    w1, w3 = (3.0 + NORM_EPSILON) / (4.0 + 2 * NORM_EPSILON), (1.0 + NORM_EPSILON) / (4.0 + 2 * NORM_EPSILON)
    assert repaired.mix == pytest.approx((w1, w3))
    assert repaired.weights[0] == pytest.approx(
        torch.full((2, 3), w1 * 1.0 + w3 * 5.0)
    )  # ~2.0: the less converged stage weighs more
    assert repaired.weights[1].shape == (3,)


def test_the_unclipped_norm_tells_neighbours_apart_where_the_clipped_one_cannot():
    left, right = _stage(0.0, 4.0, 1), _stage(8.0, 2.0, 3)  # both clipped to 1.0
    assert neighbour_weights([left, right], "clipped") == pytest.approx([0.5, 0.5])
    assert neighbour_weights([left, right], "unclipped") == pytest.approx([2 / 3, 1 / 3], rel=1e-4)


def test_a_missing_norm_counts_as_the_others_and_uniform_ignores_norms():
    unknown = Neighbour(1, FRESH, float("nan"), float("nan"))
    assert neighbour_weights([unknown, _stage(1.0, 3.0, 3)]) == pytest.approx([0.5, 0.5])
    plan = plan_repair(2, 5, available={1, 3}, rule="uniform")
    repaired = rebuild(plan, [_stage(2.0, 100.0, 1), _stage(4.0, 0.0, 3)], FRESH)
    assert repaired.rule == "uniform" and repaired.weights[0] == pytest.approx(torch.full((2, 3), 3.0))


def test_edge_stages_copy_their_swap_partner_under_checkfree_plus_and_their_neighbour_otherwise():
    assert swap_partner(1, 6) == 2 and swap_partner(5, 6) == 4 and swap_partner(3, 6) is None
    plan = plan_repair(5, 6, available={1, 2, 3, 4}, rule="checkfree_plus")
    assert (plan.rule, plan.sources) == ("copy_partner", (4,))
    repaired = rebuild(plan, [_stage(7.0, 1.0, 4)], FRESH)
    assert repaired.rule == "copy_partner" and repaired.weights[0] == pytest.approx(torch.full((2, 3), 7.0))
    plan = plan_repair(1, 6, available={2, 3, 4, 5}, rule="checkfree")
    assert (plan.rule, plan.sources) == ("copy", (2,))
    assert plan_repair(1, 3, available={2}, rule="checkfree_plus").sources == (2,)  # two block stages


def test_a_lost_neighbour_falls_back_and_says_which_rule():
    one_left = plan_repair(2, 5, available={3, 4}, rule="checkfree")
    assert (one_left.rule, one_left.sources) == ("copy", (3,)) and "[1] lost too" in one_left.note
    none_left = plan_repair(2, 4, available=set(), rule="checkfree")
    assert none_left.rule == "random" and "fresh initialisation" in none_left.note
    partner_lost = plan_repair(1, 5, available={3, 4}, rule="checkfree_plus")
    assert partner_lost.rule == "random" and "swap partner 2" in partner_lost.note
    repaired = rebuild(none_left, [], FRESH)
    assert repaired.rule == "random" and all(torch.equal(a, b) for a, b in zip(repaired.weights, FRESH, strict=True))


def test_neighbours_of_another_depth_cannot_stand_in():
    deeper = Neighbour(1, [torch.ones(4, 3), torch.ones(3)], 1.0, 1.0)
    plan = plan_repair(2, 5, available={1, 3}, rule="checkfree")
    repaired = rebuild(plan, [deeper, _stage(3.0, 1.0, 3)], FRESH)
    assert repaired.rule == "copy" and repaired.sources == (3,)
    assert rebuild(plan, [deeper], FRESH).rule == "random"


def test_checkfree_plus_swaps_partners_and_takes_turns_when_the_pairs_overlap():
    assert swapped_order([1, 2, 3, 4, 5, 6], 7, 0) == [2, 1, 3, 4, 6, 5]
    assert swapped_order([1, 2], 3, 0) == [2, 1]
    assert swapped_order([1, 2, 3], 4, 0) == [2, 1, 3]
    assert swapped_order([1, 2, 3], 4, 1) == [1, 3, 2]
    assert swapped_order([1, 3], 4, 0) == [1, 3]  # a SkipPipe path without stage 2: nothing to swap


def test_the_run_config_names_a_bad_repair_field():
    with pytest.raises(ConfigError, match="repair.rule"):
        RunConfig().replace({"repair.rule": "magic"})
    with pytest.raises(ConfigError, match="repair.weights_from"):
        RunConfig().replace({"repair.weights_from": "squared"})
    assert RunConfig().repair.swaps == 0.0
    assert RunConfig().replace({"repair.rule": "checkfree_plus"}).repair.swaps == 0.5


def test_random_re_initialisation_draws_new_weights_not_the_stages_step_0_ones():
    run = tiny_run(**{"model.init_std": 0.2})
    start = [p.detach() for p in build_stage(run.model, run.pipeline.stages, 1, run.train.seed).parameters()]
    at_27, again, at_28 = fresh_weights(run, 1, 27), fresh_weights(run, 1, 27), fresh_weights(run, 1, 28)
    assert [w.shape for w in at_27] == [w.shape for w in start]
    assert all(torch.equal(a, b) for a, b in zip(at_27, again, strict=True))  # seeded: every run draws the same
    matrices = [i for i, w in enumerate(start) if w.dim() == 2]
    for other in (start, at_28):  # unrelated draws: no weight matrix correlates with the other's
        for k in matrices:
            assert abs(float(torch.corrcoef(torch.stack([at_27[k].flatten(), other[k].flatten()]))[0, 1])) < 0.2


def test_steps_to_recover_counts_from_the_rebuilt_stages_first_step():
    val = {25: 3.0, 26: 2.9, 27: 3.4, 28: 3.0, 29: 2.89, 30: 2.7}
    assert steps_to_recover(val, before=val[26], repaired_at=27) == 2  # step 29: the first under 2.9
    assert steps_to_recover(val, before=2.0, repaired_at=27) is None  # not within the curve
    assert steps_to_recover(val, before=3.5, repaired_at=27) == 0  # under it from the first step


def test_swaps_are_spread_evenly_by_the_microbatchs_place_and_overlapping_pairs_take_turns():
    half = [swap_variant(step, m, 4, 0.5) for step in range(3) for m in range(4)]
    assert half == [None, 0, None, 1, None, 2, None, 3, None, 4, None, 5]  # every other one, as the authors
    assert [swapped_order([1, 2, 3], 4, v) for v in half if v is not None][:2] == [[2, 1, 3], [1, 3, 2]]
    quarter = [swap_variant(step, m, 4, 0.3) for step in range(10) for m in range(4)]
    assert sum(v is not None for v in quarter) == 12  # 30 % of the run's 40, though a step has 4
    assert all(swap_variant(step, m, 4, 0.0) is None for step in range(5) for m in range(4))
    assert all(swap_variant(step, m, 4, 1.0) is not None for step in range(5) for m in range(4))
