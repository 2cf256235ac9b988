"""Between tensors and the wire: own samples into a `RolloutBundle`, bundles into a training batch.

The batch is where rewards are computed, always here and always from the prompt this node derived
itself; a bundle has no field a reward could come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.grpo.sampling import Samples
from shoal.grpo.tasks import Prompt, Task
from shoal.grpo.tokenizer import PolicyTokenizer
from shoal.protocol.rollout import Completion, RolloutBundle


def to_bundle(samples: Samples, prompts: list[Prompt], model_id: str, tokenizer_id: str) -> RolloutBundle:
    """Own samples (of `prompts`, all from one round) as the plain-data bundle peers receive."""
    completions = tuple(
        Completion(prompt_index=prompts[row].index, tokens=tuple(tokens), logprobs=tuple(logprobs))
        for row, tokens, logprobs in zip(samples.prompt_rows, samples.completions, samples.logprobs, strict=True)
    )
    return RolloutBundle(prompts[0].task, prompts[0].round, model_id, tokenizer_id, completions)


@dataclass
class Batch:
    """Every completion of a round this node trains on, own first, as padded tensors."""

    prompts: list[list[int]]  # prompt token ids per row
    completions: list[list[int]]
    gen_logp: torch.Tensor  # (N, T) generator log-probs, 0 past the end
    rewards: torch.Tensor  # (N,) recomputed here
    groups: torch.Tensor  # (N,) int64: the prompt's index
    foreign: torch.Tensor  # (N,) bool


def build_batch(
    task: Task, tokenizer: PolicyTokenizer, prompts: list[Prompt], own: RolloutBundle, foreign: Sequence[RolloutBundle]
) -> Batch:
    """Rows for `own` and the (already validated) `foreign` bundles, with rewards scored locally."""
    by_index = {p.index: p for p in prompts}
    rows = [(c, False) for c in own.completions] + [(c, True) for b in foreign for c in b.completions]
    width = max((len(c.tokens) for c, _ in rows), default=0)
    gen_logp = torch.zeros(len(rows), width)
    for i, (c, _) in enumerate(rows):
        gen_logp[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
    texts = [(by_index[c.prompt_index].text, tokenizer.decode(c.tokens)) for c, _ in rows]
    return Batch(
        prompts=[tokenizer.encode_prompt(prompt) for prompt, _ in texts],
        completions=[list(c.tokens) for c, _ in rows],
        gen_logp=gen_logp,
        rewards=torch.tensor([task.reward(prompt, completion) for prompt, completion in texts]),
        groups=torch.tensor([c.prompt_index for c, _ in rows], dtype=torch.long),
        foreign=torch.tensor([is_foreign for _, is_foreign in rows], dtype=torch.bool),
    )
