"""GRPO and F-TIS losses on hand-computed groups: advantages, clipping, IS truncation, filtering, KL.

Run: .venv/bin/python -m pytest -q tests/test_grpo_losses.py
"""

from __future__ import annotations

import math

import pytest
import torch

from shoal.grpo.loss import GRPOConfig, ftis_keep, group_advantages, grpo_loss, k3, truncated_is_weights

SQRT3 = math.sqrt(3.0)


def test_advantages_are_divided_by_the_group_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups)
    # group 0: mean 1/4, population std sqrt(3)/4 -> (3/4)/(sqrt3/4) = sqrt3 and -(1/4)/(sqrt3/4) = -1/sqrt3
    expected = torch.tensor([SQRT3, -1 / SQRT3, -1 / SQRT3, -1 / SQRT3, 1.0, -1.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)  # group 1: ±1 whatever the reward scale


def test_the_epsilon_is_added_to_the_std() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 / 1.0, -0.5 / 1.0]))


def test_equal_rewards_give_exactly_zero_advantage() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    adv = group_advantages(rewards, groups)
    assert adv[:5].eq(0).all() and adv[5:].eq(0).all()  # a group of one is all-equal too


def test_unused_samples_leave_the_group_statistics_and_get_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0])
    used = torch.tensor([True, True, False, False])
    torch.testing.assert_close(group_advantages(rewards, groups, used), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_k3_is_zero_at_equal_probabilities_and_matches_its_formula() -> None:
    x = torch.tensor([0.0, math.log(2.0), -1.0])
    torch.testing.assert_close(k3(x), torch.tensor([0.0, 2 - math.log(2) - 1, math.exp(-1) + 1 - 1]))
    assert (k3(torch.linspace(-5, 5, 11)) >= 0).all()


def test_importance_weights_are_truncated_and_carry_no_gradient() -> None:
    logp = torch.log(torch.tensor([0.3, 0.2, 0.9])).requires_grad_(True)
    gen = torch.log(torch.tensor([0.1, 0.4, 0.9]))
    w = truncated_is_weights(logp, gen, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 1.0]))  # 3 -> capped at 2
    assert not w.requires_grad


def _batch(logp: list[list[float]], gen: list[list[float]], rewards: list[float], foreign: list[bool]) -> dict:
    lp = torch.tensor(logp).requires_grad_(True)
    return dict(
        logp=lp,
        gen_logp=torch.tensor(gen),
        mask=torch.ones_like(lp, dtype=torch.bool),
        rewards=torch.tensor(rewards),
        groups=torch.zeros(len(rewards), dtype=torch.long),
        foreign=torch.tensor(foreign),
    )


def _grad(batch: dict, **cfg) -> tuple[torch.Tensor, object]:
    loss, stats = grpo_loss(**batch, cfg=GRPOConfig(**cfg))
    loss.backward()
    return batch["logp"].grad, stats


def test_own_samples_use_the_ppo_clip() -> None:
    # Two own samples of one token: A = +1 (ratio 1.5, clipped at 1.2: no gradient) and
    # A = -1 (ratio 1.5: min(-1.5, -1.2) = -1.5 is the unclipped term, gradient -A * ratio / N).
    log15 = math.log(1.5)
    batch = _batch([[log15 - 1.0], [log15 - 2.0]], [[-1.0], [-2.0]], [1.0, 0.0], [False, False])
    grad, stats = _grad(batch, mode="alone", clip_eps=0.2)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [1.5 / 2]]))
    assert stats.loss == pytest.approx(-(1.2 * 1 + 1.5 * -1) / 2, abs=1e-5)  # eps in the std


def test_tis_weights_foreign_gradients_by_the_truncated_ratio() -> None:
    # own: A = +1, on-policy; foreign: A = -1, two tokens, ratios 3 (-> 2) and 0.5.
    batch = _batch(
        [[-1.0, -1.0], [math.log(0.3), math.log(0.2)]],
        [[-1.0, -1.0], [math.log(0.1), math.log(0.4)]],
        [1.0, 0.0],
        [False, True],
    )
    grad, stats = _grad(batch, mode="tis", is_cap=2.0)
    # d loss / d logp_{i,t} = -w_{i,t} A_i / (T_i N): own -1/(2*2); foreign +2/(2*2) and +0.5/(2*2)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.5, 0.125]]))
    assert stats.foreign_mean_weight == pytest.approx(1.25) and stats.foreign_truncated == pytest.approx(0.5)
    assert stats.foreign_dropped == 0


def test_naive_sharing_ignores_the_generator() -> None:
    batch = _batch([[-1.0], [math.log(0.3)]], [[-1.0], [math.log(0.01)]], [1.0, 0.0], [False, True])
    grad, _ = _grad(batch, mode="naive")
    torch.testing.assert_close(grad, torch.tensor([[-0.5], [0.5]]))  # ratio 30 plays no part


def test_alone_drops_foreign_samples_from_groups_and_loss() -> None:
    logp, gen = [[-1.0], [-0.5], [-0.2]], [[-1.0], [-0.5], [-3.0]]
    grad, stats = _grad(_batch(logp, gen, [1.0, 0.0, 1.0], [False, False, True]), mode="alone")
    alone_grad, _ = _grad(_batch(logp[:2], gen[:2], [1.0, 0.0], [False, False]), mode="alone")
    torch.testing.assert_close(grad[:2], alone_grad)
    assert grad[2].eq(0).all() and stats.used == 2 and stats.foreign_used == 0


def test_ftis_drops_only_foreign_negatives_far_from_the_learner() -> None:
    far, near = math.log(0.9), math.log(0.85)  # generator log-probs; the learner gives these tokens 0.05
    learner = math.log(0.05)
    batch = _batch(
        [[learner], [learner], [learner], [learner], [-0.1]],
        [[far], [far], [near], [learner], [-0.1]],
        [0.0, 1.0, 0.0, 0.0, 0.0],
        [True, True, True, True, False],
    )
    adv = group_advantages(batch["rewards"], batch["groups"])
    kl = k3(batch["gen_logp"] - batch["logp"].detach()).squeeze(-1)
    assert kl[0] > 2.0 and kl[3] == 0  # far foreign: ~15 nats; the on-policy-looking one: 0
    threshold = 0.5
    keep = ftis_keep(adv, kl, batch["foreign"], threshold)
    assert keep.tolist() == [False, True, False, True, True]  # negatives far off dropped; positive kept
    grad, stats = _grad(batch, mode="ftis", kl_threshold=threshold, is_cap=2.0)
    assert grad[0].eq(0).all() and grad[2].eq(0).all()
    assert not grad[1].eq(0).any() and not grad[3].eq(0).any()
    assert (stats.foreign_dropped, stats.foreign_used, stats.used) == (2, 2, 5)
    tis_grad, _ = _grad({**batch, "logp": batch["logp"].detach().clone().requires_grad_(True)}, mode="tis")
    torch.testing.assert_close(grad[1], tis_grad[1])  # kept samples: exactly TIS, dropped still in the mean


def test_padding_tokens_add_nothing_and_each_sample_is_a_token_mean() -> None:
    batch = _batch(
        [[-1.0, -1.0, -7.0], [-1.0, 0.0, 0.0]], [[-1.0, -1.0, -7.0], [-1.0, 0.0, 0.0]], [1.0, 0.0], [False, False]
    )
    batch["mask"] = torch.tensor([[True, True, True], [True, False, False]])
    grad, _ = _grad(batch, mode="alone")
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.5, 0.0, 0.0]]))


def test_kl_to_the_reference_uses_k3_and_its_gradient() -> None:
    batch = _batch([[-1.0], [-1.0]], [[-1.0], [-1.0]], [1.0, 1.0], [False, False])  # zero advantages
    ref = torch.tensor([[-1.5], [-1.0]])
    loss, stats = grpo_loss(**batch, cfg=GRPOConfig(mode="alone", kl_coef=0.1), ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (math.exp(-0.5) + 0.5 - 1) / 2)
    # d/dlogp of beta * k3(ref - logp) / N = beta * (1 - exp(ref - logp)) / N
    torch.testing.assert_close(batch["logp"].grad, torch.tensor([[0.1 * (1 - math.exp(-0.5)) / 2], [0.0]]))
    assert stats.ref_kl == pytest.approx((math.exp(-0.5) + 0.5 - 1) / 2)


def test_an_unknown_mode_is_refused() -> None:
    batch = _batch([[-1.0]], [[-1.0]], [1.0], [False])
    with pytest.raises(ValueError, match="mode"):
        grpo_loss(**batch, cfg=GRPOConfig(mode="sapo"))  # type: ignore[arg-type]
