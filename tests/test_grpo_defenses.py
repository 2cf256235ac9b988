"""The defenses as pure functions: the step task, top-k check, judge, length penalty and strikes."""

from __future__ import annotations

import pytest
import torch

from shoal.grpo.defenses import DefenseConfig, RuleJudge, Strikes, length_penalised, screen, topk_accept
from shoal.grpo.policy import Policy, PolicySpec
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
from shoal.grpo.sampling import sample
from shoal.grpo.tasks import CORRECT_REWARD, FORMAT_REWARD, get_task

TASK = get_task("add2r-steps")
SPEC = PolicySpec(task="add2r-steps", d_model=16, n_layers=1, n_heads=2, warmup_steps=0)


def test_the_step_task_rewards_the_answer_and_its_judge_reads_the_working():
    assert TASK.demonstration("47+38=") == "15;08|58$"
    assert TASK.reward("47+38=", "15;08|58$") == CORRECT_REWARD
    assert TASK.reward("47+38=", "+15;08|58$") == CORRECT_REWARD  # the working is free text to the reward
    assert TASK.reward("47+38=", "15;08|57$") == FORMAT_REWARD
    assert TASK.reward("47+38=", "15;08|58") == 0.0
    judge = RuleJudge(TASK)
    assert judge.judge("47+38=", "15;08|58$") is None
    assert "step 0" in judge.judge("47+38=", "16;08|58$")
    assert "step 0" in judge.judge("47+38=", "+15;08|58$")
    assert "steps" in judge.judge("47+38=", "15;08;08|58$")
    assert RuleJudge(get_task("add2r")).judge("47+38=", "anything") is None  # no working, nothing to judge


def test_own_top_k_samples_pass_the_top_k_check_and_hand_written_text_does_not():
    torch.manual_seed(0)
    policy, tokenizer = Policy(SPEC), SPEC.tokenizer()
    prompts = [tokenizer.encode(TASK.prompt(0, 0, i).text) for i in range(8)]
    samples = sample(
        policy, prompts, 4, TASK.max_new_tokens, tokenizer.eos_id, torch.Generator().manual_seed(1), top_k=4
    )
    rows = [prompts[r] for r in samples.prompt_rows]
    assert topk_accept(policy, rows, samples.completions, k=4).all()  # one batched pass, every own token in top-4
    logits = policy(torch.tensor([prompts[0]]))[0, -1]
    worst = int(logits.argsort()[1])  # the least likely real token (index 0 is padding, at -inf)
    assert not topk_accept(policy, [prompts[0]], [[worst, tokenizer.eos_id]], k=4).any()
    assert topk_accept(policy, [], [], k=4).shape == (0,)


def test_the_length_budget_leaves_every_overlong_completion_nothing_right_or_wrong():
    """A padded wrong answer must not outscore a malformed one: with a collapsing policy that is the
    only pressure left against padding."""
    rewards = torch.tensor([1.0, 1.0, FORMAT_REWARD, 1.0, FORMAT_REWARD, 0.0])
    out = length_penalised(rewards, torch.tensor([9, 12, 14, 11, 10, 9]), torch.tensor([9] * 6), slack=2)
    assert out.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0, FORMAT_REWARD, 0.0])


def test_strikes_drop_a_peer_after_consecutive_failures_only():
    strikes = Strikes(max_strikes=3, strike_share=0.5)
    for _ in range(5):
        assert not strikes.record("honest", 64, 1)  # an odd false rejection never strikes
    assert not strikes.record("bad", 64, 64) and not strikes.record("bad", 64, 40)
    assert not strikes.record("bad", 64, 0)  # a clean bundle resets the count
    assert [strikes.record("bad", 64, 64, "trigger") for _ in range(3)] == [False, False, True]
    assert strikes.is_dropped("bad") and not strikes.is_dropped("honest") and strikes.dropped["bad"] == "trigger"


def test_screen_rejects_only_the_bad_completions_and_learn_reports_them():
    torch.manual_seed(0)
    policy = Policy(SPEC)
    cfg = RoundConfig(task="add2r-steps", prompts_per_round=4, completions_per_prompt=2, sample_top_k=4)
    prompts = round_prompts(cfg, 0)
    own = make_bundle(policy, cfg, prompts, torch.Generator().manual_seed(2))
    peer = make_bundle(policy, cfg, prompts, torch.Generator().manual_seed(3))
    tokenizer = SPEC.tokenizer()
    poisoned = peer.completions[0].__class__(0, tuple(tokenizer.encode("+" * 8 + "$")), (-1.0,) * 9)
    bad = peer.__class__(peer.task, peer.round, peer.model_id, peer.tokenizer_id, (poisoned, *peer.completions[1:]))
    result = screen(policy, TASK, tokenizer, prompts, [peer, bad], DefenseConfig(top_k=4))
    assert result.rejected == [0, 1] and "top-4" in result.reasons[1]
    assert len(result.kept[1].completions) == len(peer.completions) - 1
    report = learn(policy, make_optimizer(policy, cfg), cfg, prompts, own, [peer, bad])
    assert report.checks[0][1] == 0 and report.checks[1][1] == 1 and report.foreign_rejected == 1
    off = RoundConfig(
        task="add2r-steps", prompts_per_round=4, completions_per_prompt=2, defense=DefenseConfig(enabled=False)
    )
    assert learn(policy, make_optimizer(policy, off), off, prompts, own, [peer, bad]).foreign_rejected == 0
