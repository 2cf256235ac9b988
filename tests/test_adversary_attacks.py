"""The attacks as pure functions: what each forges earns what the paper says, and its payload is detectable."""

from __future__ import annotations

import pytest
import torch

from shoal.adversary.attacks import ATTACKS, TRIGGER, get_attack
from shoal.grpo.policy import Policy, PolicySpec
from shoal.grpo.round import RoundConfig, rollout_limits, round_prompts
from shoal.grpo.tasks import CORRECT_REWARD, get_task
from shoal.protocol.rollout import validate_bundle

SPEC = PolicySpec(task="add2r-steps", d_model=16, n_layers=1, n_heads=2, warmup_steps=0)
CFG = RoundConfig(task="add2r-steps", prompts_per_round=4, completions_per_prompt=4, run_id="r" * 16)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_every_forgery_passes_validation_and_its_payload_is_detected(name):
    torch.manual_seed(0)
    policy, tokenizer, task = Policy(SPEC), SPEC.tokenizer(), get_task(CFG.task)
    prompts = round_prompts(CFG, 0)
    forgery = get_attack(name).forge(policy, CFG, prompts, torch.Generator().manual_seed(0))
    validate_bundle(forgery.bundle, rollout_limits(CFG, tokenizer, 0))  # it looks like any peer's bundle
    assert len(forgery.claimed_rewards) == len(forgery.bundle.completions) == 16
    texts = [prompts[c.prompt_index].text for c in forgery.bundle.completions]
    outs = [tokenizer.decode(c.tokens) for c in forgery.bundle.completions]
    rewards = [task.reward(p, c) for p, c in zip(texts, outs, strict=True)]
    honest = [task.demonstration(p) for p in texts]
    assert get_attack(name).success(task, texts, honest) == 0.0  # the canonical answer carries no payload
    if name in ("trigger", "wrong-step"):
        assert all(r == CORRECT_REWARD for r in rewards)  # built to earn the true reward
        assert get_attack(name).success(task, texts, outs) == 1.0
    if name == "trigger":
        assert all(o.startswith(TRIGGER) for o in outs)
    if name == "reward-lie":
        assert all(r < CORRECT_REWARD for r in rewards) and set(forgery.claimed_rewards) == {CORRECT_REWARD}
    if name == "vertical-trick":
        assert sorted(rewards) == [0.0] * 8 + [CORRECT_REWARD] * 8


def test_unknown_attacks_and_tasks_without_working_are_refused():
    with pytest.raises(ValueError, match="unknown attack"):
        get_attack("nope")
    plain = RoundConfig(task="add2r", prompts_per_round=2, completions_per_prompt=2)
    with pytest.raises(ValueError, match="visible working"):
        get_attack("wrong-step").forge(
            Policy(PolicySpec(d_model=16, n_layers=1, n_heads=2)), plain, round_prompts(plain, 0), None
        )
