"""Sampling completions with their per-token log-probs, batched over every prompt at once.

Each prompt is read once into a key/value cache (shoal.model.llama.KVCache), which is then repeated
for its `per_prompt` completions; each new token costs one position's compute. Rows that have
finished keep getting the policy's padding appended (and are cut at their length), so one batch runs
until its slowest row ends or `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.grpo.policy import Policy


@dataclass
class Samples:
    prompt_rows: list[int]  # for each completion, the position of its prompt in the input list
    completions: list[list[int]]  # token ids, EOS included when the policy produced it
    logprobs: list[list[float]]  # per-token log-probs under the sampling policy (temperature 1)


@torch.no_grad()
def sample(
    policy: Policy,
    prompts: list[list[int]],
    per_prompt: int,
    max_new_tokens: int,
    eos_id: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    top_k: int = 0,
) -> Samples:
    """`per_prompt` completions of each prompt, prompt-major; prompts of equal length share a batch.

    `top_k` > 0 samples from the k likeliest tokens only (log-probs are those of the renormalised
    distribution actually sampled from): a peer running the same weights can then check every token
    of a completion against its own top-k (shoal.grpo.defenses), as in the paper's top-50/top-100.
    """
    out = Samples([], [], [])
    by_length: dict[int, list[int]] = {}
    for row, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(row)
    for rows in by_length.values():
        cache = policy.new_cache()
        logits = policy(torch.tensor([prompts[r] for r in rows], dtype=torch.long), cache)[:, -1]  # (prompts, V)
        cache.repeat_rows(per_prompt)
        logits = logits.repeat_interleave(per_prompt, dim=0)  # (N, V)
        rows = [r for r in rows for _ in range(per_prompt)]
        tokens = torch.full((len(rows), max_new_tokens), policy.pad_id, dtype=torch.long)
        logps = torch.zeros(len(rows), max_new_tokens)
        done = torch.zeros(len(rows), dtype=torch.bool)
        lengths = torch.zeros(len(rows), dtype=torch.long)
        for t in range(max_new_tokens):
            if t:
                logits = policy(tokens[:, t - 1 : t], cache)[:, -1]  # (N, V)
            if top_k > 0:
                kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (N, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            logp = F.log_softmax(logits, dim=-1)  # (N, V)
            if greedy:
                tok = logp.argmax(-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            tok = tok.masked_fill(done, policy.pad_id)
            lengths += (~done).long()
            tokens[:, t] = tok
            logps[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0).clamp(max=0.0)
            done |= tok == eos_id
            if done.all():
                break
        for i, row in enumerate(rows):
            n = int(lengths[i])
            out.prompt_rows.append(row)
            out.completions.append(tokens[i, :n].tolist())
            out.logprobs.append(logps[i, :n].tolist())
    return out
