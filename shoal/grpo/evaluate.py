"""Held-out accuracy: greedy answers to prompts from the task's evaluation split, scored by its rule."""

from __future__ import annotations

from shoal.grpo.policy import Policy
from shoal.grpo.sampling import sample
from shoal.grpo.tasks import CORRECT_REWARD, EVAL, Prompt, Task, task_seed


def heldout_prompts(task: Task, seed: int, count: int) -> list[Prompt]:
    """A fixed evaluation set: operand pairs training prompts never show."""
    return [task.prompt(task_seed(seed, "heldout"), 0, i, EVAL) for i in range(count)]


def accuracy(policy: Policy, task: Task, prompts: list[Prompt]) -> float:
    """Share of prompts whose greedy completion earns the full reward."""
    tokenizer = policy.spec.tokenizer()
    was_training = policy.training
    policy.eval()
    encoded = [tokenizer.encode_prompt(p.text) for p in prompts]
    samples = sample(policy, encoded, 1, task.max_new_tokens, tokenizer.eos_id, greedy=True)
    policy.train(was_training)
    rewards = [
        task.reward(prompts[row].text, tokenizer.decode(tokens))
        for row, tokens in zip(samples.prompt_rows, samples.completions, strict=True)
    ]
    return sum(r == CORRECT_REWARD for r in rewards) / max(len(prompts), 1)
