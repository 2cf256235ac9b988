"""The attacks as pure functions: what each forges earns what the paper says, and its payload is detectable."""

from __future__ import annotations

import pytest
import torch

from shoal.adversary.attacks import ATTACKS, TRIGGER, get_attack, padded_text
from shoal.grpo.defenses import ClaimJudge, group_length_penalised
from shoal.grpo.policy import Policy, PolicySpec
from shoal.grpo.round import RoundConfig, rollout_limits, round_prompts
from shoal.grpo.tasks import CORRECT_REWARD, FORMAT_REWARD, get_task
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
    if name == "reward-lie":  # every claim is the opposite of the truth: lies claimed 1, right answers 0
        assert (
            sorted(zip(rewards, forgery.claimed_rewards, strict=True))
            == [(FORMAT_REWARD, 1.0)] * 8 + [(CORRECT_REWARD, 0.0)] * 8
        )
        assert get_attack(name).success(task, texts, outs) == 0.5
    if name == "vertical-trick":
        assert sorted(rewards) == [0.0] * 8 + [CORRECT_REWARD] * 8
        assert list(forgery.claimed_rewards) == rewards  # it needs no lie: the true rewards give Â = +1
    if name == "length":
        assert all(r == CORRECT_REWARD for r in rewards) and list(forgery.claimed_rewards) == rewards
        assert get_attack(name).success(task, texts, outs) == 1.0
        assert all(len(o) - len(h) >= 6 for o, h in zip(outs, honest, strict=True))


def test_padding_counts_extra_steps_that_cost_length_and_not_a_collapsing_policys_noise():
    """Seen in daemon runs at lr 1e-3: a collapsed policy writes short garbage with three steps, or one
    token too many; neither is the DoS. A padded working (extra steps, and their tokens) is."""
    task, padding = get_task("add2r-steps"), get_attack("length")
    prompt = "16+68="  # canonical 14;08|48$
    assert padding.success(task, [prompt] * 3, ["10;1;1|1$", "14;08|481$", "14;08|48$"]) == 0.0
    assert padding.success(task, [prompt] * 3, ["14;08;14;08|48$", "14;08;12|48$", "14;07;13;10|301$"]) == 1.0


def test_the_length_attack_is_correct_and_long_and_the_length_rule_cuts_its_reward():
    """The analogue earns the full reward from the task (its answer is right); the length rule (more than
    `length_excess` = 25 % over the group's shortest right answer) leaves it nothing beside an honest
    right answer, and the claim judge also refuses it (its repeated steps claim columns the sum does
    not have), where the paper's judge passed its DoS."""
    task = get_task("add2r-steps")
    for prompt, canonical in (("47+38=", "15;08|58$"), ("99+99=", "18;19|891$")):
        long = padded_text(task, prompt)
        assert task.demonstration(prompt) == canonical and long.startswith(canonical[:5] + ";")
        assert task.reward(prompt, long) == CORRECT_REWARD and len(long) <= task.max_new_tokens
        cut = group_length_penalised(
            torch.tensor([CORRECT_REWARD, CORRECT_REWARD]),
            torch.tensor([len(long), len(canonical)]),
            torch.tensor([0, 0]),
            excess=0.25,
        )
        assert cut.tolist() == pytest.approx([0.0, CORRECT_REWARD])
        assert "past the last column" in ClaimJudge(task).judge(prompt, long)


def test_unknown_attacks_and_tasks_without_working_are_refused():
    with pytest.raises(ValueError, match="unknown attack"):
        get_attack("nope")
    plain = RoundConfig(task="add2r", prompts_per_round=2, completions_per_prompt=2)
    with pytest.raises(ValueError, match="visible working"):
        get_attack("wrong-step").forge(
            Policy(PolicySpec(d_model=16, n_layers=1, n_heads=2)), plain, round_prompts(plain, 0), None
        )
