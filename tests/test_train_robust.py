"""The robust outer step: partners far outside a replica's recent distribution are refused, honest ones
taken, and a DiLoCo mean is clipped toward our own pseudo-gradient (CenteredClip)."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.config import OptimConfig
from shoal.train.robust import (
    OuterHistory,
    adam_step_bound,
    centered_clip,
    distance,
    epoch_step_bound,
    norm,
    remember,
    screen_mean,
    screen_partner,
)


def replica(gen: torch.Generator, scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.randn(8, 4, generator=gen) * scale, torch.randn(6, generator=gen) * scale]


def honest_pair(gen: torch.Generator, drift: float = 0.1) -> tuple[list, list, list, list]:
    """Two replicas that share slow weights and took similar steps (Δs of the same size)."""
    phi = replica(gen)
    common = replica(gen, drift)
    mine = [c + d for c, d in zip(common, replica(gen, drift / 2), strict=True)]
    theirs = [c + d for c, d in zip(common, replica(gen, drift / 2), strict=True)]
    return phi, mine, [p.clone() for p in phi], theirs


def test_an_honest_partner_is_taken_from_the_first_step_on():
    gen = torch.Generator().manual_seed(0)
    history = OuterHistory()
    for _ in range(10):
        phi, delta, their_phi, their_delta = honest_pair(gen)
        verdict = screen_partner(phi, delta, their_phi, their_delta, history, tolerance=3.0)
        assert verdict.accepted, verdict.reason
        history = remember(history, norm(delta), verdict, window=8)
    assert len(history.delta_norms) == 8 and len(history.distances) == 8


@pytest.mark.parametrize("attack", ["scaled", "garbage", "far"])
def test_a_partner_far_outside_the_distribution_is_refused_and_kept_out_of_the_history(attack):
    gen = torch.Generator().manual_seed(1)
    history = OuterHistory()
    for _ in range(4):
        phi, delta, their_phi, their_delta = honest_pair(gen)
        history = remember(history, norm(delta), screen_partner(phi, delta, their_phi, their_delta, history, 3.0), 8)
    phi, delta, their_phi, their_delta = honest_pair(gen)
    if attack == "scaled":  # Δ × 20, as the `scaled` replica sends it
        their_delta = [d * 20 for d in their_delta]
    elif attack == "garbage":  # random slow weights of the right size
        their_phi = [torch.randn(p.shape, generator=gen) * p.norm() / math.sqrt(p.numel()) for p in their_phi]
    else:  # a backdoor blended in: the same-sized step, plus a direction the others do not take
        their_delta = [d + 10 * torch.randn(d.shape, generator=gen) * 0.1 for d in their_delta]
    verdict = screen_partner(phi, delta, their_phi, their_delta, history, tolerance=3.0)
    assert not verdict.accepted
    assert ("pseudo-gradient norm" in verdict.reason) == (attack != "garbage")
    after = remember(history, norm(delta), verdict, 8)
    assert after.distances == history.distances  # a refused partner cannot widen the window it is judged by


def test_limits_come_from_our_own_steps_and_ignore_empty_epochs():
    phi, delta = [torch.zeros(4)], [torch.ones(4)]  # ‖Δ‖ = 2
    history = OuterHistory(delta_norms=(0.0, 0.0, 2.0), distances=(0.0, 1.0))
    verdict = screen_partner(phi, delta, [torch.zeros(4)], [torch.full((4,), 2.9)], history, tolerance=3.0)
    assert verdict.delta_limit == pytest.approx(6.0)  # 3 × median(2, 2): the epochs without a step left out
    assert verdict.distance_limit == pytest.approx(6.0)  # 2·3 × median(1): distances get twice the slack
    assert verdict.accepted  # ‖Δ_partner‖ = 5.8, distance 3.8
    cold = screen_partner(phi, delta, [torch.zeros(4)], [torch.ones(4)], OuterHistory(), 3.0)
    assert cold.delta_limit == pytest.approx(6.0) and cold.distance_limit == pytest.approx(6.0) and cold.accepted
    bounded = screen_partner(phi, delta, [torch.zeros(4)], [torch.ones(4)], OuterHistory(), 3.0, step_bound=4.0)
    assert bounded.distance_limit == pytest.approx(8.0)  # two replicas M from the same φ are at most 2M apart
    idle = screen_partner(phi, [torch.zeros(4)], [torch.zeros(4)], [torch.ones(4)], OuterHistory(), 3.0)
    assert idle.accepted and math.isinf(idle.delta_limit)  # nothing to compare with: no refusal on no evidence
    far = [torch.full((4,), 4.5)]  # ‖Δ‖ = 9: over 3 × our median, but within what the epoch's steps can move
    assert not screen_partner(phi, delta, [torch.zeros(4)], far, history, 3.0).accepted
    assert screen_partner(
        phi, delta, [torch.zeros(4)], far, OuterHistory(delta_norms=(2.0,)), 3.0, step_bound=9.5
    ).accepted


def test_what_adamw_steps_can_move_judges_a_partner_without_a_step_of_ours_and_caps_every_limit():
    phi, idle = [torch.zeros(4)], [torch.zeros(4)]  # no microbatch routed to us this epoch, nothing before
    honest, backdoor = [torch.full((4,), 0.9)], [torch.full((4,), 1.5)]  # ‖Δ‖ = 1.8 and 3.0 with M = 2
    assert screen_partner(phi, idle, [torch.zeros(4)], honest, OuterHistory(), 3.0, step_bound=2.0).accepted
    refused = screen_partner(phi, idle, [torch.zeros(4)], backdoor, OuterHistory(), 3.0, step_bound=2.0)
    assert not refused.accepted and refused.delta_limit == pytest.approx(2.5) and "pseudo-gradient" in refused.reason
    # once we have a Δ of our own, k × its median rules (M a floor), but 1.25 M stays the ceiling:
    # 3 × 1.2 = 3.6 would take the backdoor's 3.0 (honest Δs vary 2-3x within an epoch)
    seen = OuterHistory(delta_norms=(1.2,))
    capped = screen_partner(phi, idle, [torch.zeros(4)], backdoor, seen, 3.0, step_bound=2.0)
    assert not capped.accepted and capped.delta_limit == pytest.approx(2.5) and "epoch's steps" in capped.reason
    assert screen_partner(phi, idle, [torch.zeros(4)], honest, seen, 3.0, step_bound=2.0).accepted
    small = OuterHistory(delta_norms=(0.3,))  # 3 × 0.3 < M: M is the floor, and an honest 1.8 passes
    assert screen_partner(phi, idle, [torch.zeros(4)], honest, small, 3.0, step_bound=2.0).delta_limit == 2.0


def test_a_replica_that_never_took_a_partner_takes_one_as_far_as_it_drifted_but_not_garbage():
    """One of three NoLoCo replicas is always left without a partner; after four epochs alone one was
    honestly 4.4 from the others (paired ones were 0.9-1.7 apart) in a daemon run, and refused them."""
    phi, delta = [torch.full((4,), 6.0)], [torch.full((4,), 0.1)]  # ‖θ‖ = 12.2, ‖Δ_own‖ = 0.2
    history = OuterHistory(delta_norms=(1.5, 1.5, 1.0))
    for moved in (1.1, 1.5, 1.3, 1.0):  # four local steps: no partner came
        history = remember(history, 1.0, None, 8, moved)
    assert history.alone == pytest.approx(4.9) and not history.took_any
    honest = [torch.full((4,), 8.2)]  # slow weights 4.4 away: within twice its drift since it started
    verdict = screen_partner(phi, delta, honest, delta, history, tolerance=3.0)
    assert verdict.accepted and verdict.distance_limit == pytest.approx(2 * (4.9 + 0.2))
    garbage = [torch.full((4,), -2.0)]  # 16 away, further than its own weights' size: shares nothing with it
    assert not screen_partner(phi, delta, garbage, delta, history, tolerance=3.0).accepted
    refused = remember(history, 0.2, screen_partner(phi, delta, garbage, delta, history, 3.0), 8, moved=0.7)
    assert refused.alone == pytest.approx(history.alone + 0.7)  # a refusal is an epoch alone too
    assert not screen_partner(phi, delta, garbage, delta, refused, tolerance=3.0).accepted  # still past ‖θ‖
    after = remember(history, 0.2, verdict, 8, moved=0.7)
    assert after.alone == 0.0 and after.took_any and after.distances == (verdict.distance,)
    for moved in (1.1, 1.5, 1.3, 1.0):  # alone again: from now on its distances judge, not its drift
        after = remember(after, 1.0, None, 8, moved)
    far = [torch.full((4,), 6.0 + 4.4)]  # 8.8 away: under 2A = 10.2, over 2k x its median distance 4.4
    assert screen_partner(phi, delta, far, delta, history, tolerance=0.9).accepted
    assert not screen_partner(phi, delta, far, delta, after, tolerance=0.9).accepted


def test_the_step_bound_is_what_adamw_steps_can_move():
    assert adam_step_bound([0.01, 0.02], parameters=10_000) == pytest.approx(3.0)
    warming = OptimConfig(lr=0.01, warmup_steps=2, min_lr_ratio=1.0)  # steps 0, 1 at lr/2, lr; then lr
    assert epoch_step_bound(warming, 100, inner_steps=2, epoch=1, parameters=10_000) == pytest.approx(1.5)
    assert epoch_step_bound(warming, 100, inner_steps=2, epoch=3, parameters=10_000) == pytest.approx(2.0)


def test_centered_clip_moves_a_value_toward_the_center_to_the_radius():
    center, value = [torch.zeros(3)], [torch.tensor([3.0, 4.0, 0.0])]
    clipped = centered_clip(center, value, radius=1.0)
    assert distance(clipped, center) == pytest.approx(1.0)
    assert torch.allclose(clipped[0], torch.tensor([0.6, 0.8, 0.0]))
    assert torch.equal(centered_clip(center, value, radius=10.0)[0], value[0])  # within the radius: untouched


def test_a_diloco_mean_pulled_by_a_scaled_replica_is_clipped_toward_ours():
    gen = torch.Generator().manual_seed(2)
    ours, other = replica(gen, 0.1), replica(gen, 0.1)
    honest_mean = [(a + b) / 2 for a, b in zip(ours, other, strict=True)]
    mean, verdict = screen_mean(ours, honest_mean, OuterHistory(), tolerance=3.0)
    assert verdict.accepted and all(torch.equal(m, h) for m, h in zip(mean, honest_mean, strict=True))
    history = remember(OuterHistory(), norm(ours), verdict, 8)
    poisoned = [(a + 20 * b) / 2 for a, b in zip(ours, other, strict=True)]
    mean, verdict = screen_mean(ours, poisoned, history, tolerance=3.0)
    assert not verdict.accepted and "clipped" in verdict.reason
    assert distance(mean, ours) == pytest.approx(verdict.distance_limit, rel=1e-5)
    assert distance(mean, ours) < distance(poisoned, ours) / 2
