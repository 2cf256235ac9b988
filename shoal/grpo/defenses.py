"""Defenses against poisoned rollouts (Hail to the Thief, grpo_attacks.md): checks a receiver runs
on every foreign completion before it joins a group, and a strike count that drops a bad source.

- Rewards are never read from a bundle: `build_batch` scores every completion from the prompt this
  node derived itself, and a bundle's `claimed_rewards` are ignored (only an experiment's undefended
  node, `DefenseConfig(enabled=False)`, believes them: `shoal.grpo.round.learn`).
- Same policy (the bundle's model id is this node's): every token of a foreign completion must be
  among the receiver's own top-k predictions at its position, for all completions in one batched
  forward pass (`topk_accept`). The paper samples top-50 and checks top-100 over a ~150k vocabulary;
  here the vocabulary has 16 ids, honest nodes sample from the top 4 and the check keeps the top 6
  (k_v > k_g absorbs the drift between two nodes' weights after a few rounds apart). Hand-written
  text, like a trigger phrase, almost surely leaves the top 6.
- Different policy: a judge reads the working. The paper asks Llama-3.1-8B-Instruct whether every
  step is correct and relevant; `RuleJudge` stands in for it with the task's own step verifier
  (a substitute: exact, free, and blind to anything but the steps). A real judge model implements
  the same `Judge` protocol.
- Length (the paper's DoS, which neither of its checks stops: correct but needlessly long answers):
  the rule is a length budget: a completion longer than the task's canonical answer by more than
  `length_slack` (2) tokens earns nothing, right or wrong (DAPO's overlong penalty is the same idea).
  Applied to every completion, own included, as part of the reward, so an over-long answer always
  gets the group's lowest reward and a non-positive advantage, and a node's own drift towards length
  is penalised too. Cutting only correct answers to the format reward, as this rule first did, left
  padding level with a well-formed wrong answer: once an honest undefended peer had learnt to pad,
  its padded wrong answers outscored malformed ones in a defended node's groups. It catches the `length`
  attack's analogue (the working written twice: +6 tokens), which the step judge also refuses; on
  this task a working has one length per sum, so 2 tokens of slack costs an honest answer nothing.
- `Strikes`: a peer whose bundles keep failing (at least `strike_share` of a bundle rejected,
  `max_strikes` times in a row) is dropped from the node's sources for the rest of the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shoal.grpo.policy import Policy, completion_logits
from shoal.grpo.tasks import CORRECT_REWARD, Prompt, Task
from shoal.grpo.tokenizer import PolicyTokenizer
from shoal.protocol.rollout import RolloutBundle

MAX_DROPPED = 16  # sources a node remembers (and advertises) as dropped


@dataclass(frozen=True)
class DefenseConfig:
    enabled: bool = True  # off only in experiments (benchmarks/attacks.py, --experiment runs)
    top_k: int = 6  # k_v: a same-policy completion's tokens must all be in the receiver's top k
    length_slack: int = 2  # tokens over the canonical answer a correct completion may spend at full reward
    max_strikes: int = 0  # failing bundles in a row before their sender is dropped; 0: never
    strike_share: float = 0.5  # a bundle fails when at least this share of its completions is rejected


class Judge(Protocol):
    """Reads one completion's working; the paper's LLM judge or a rule-based stand-in."""

    name: str

    def judge(self, prompt_text: str, completion_text: str) -> str | None:
        """The reason to reject the completion, or None to accept it."""
        ...


@dataclass(frozen=True)
class RuleJudge:
    """The task's step verifier as a judge (a substitute for the paper's LLM judge, stated as such).

    A task without visible working (plain `add2r`) has nothing to judge: every completion passes,
    and only the reward, recomputed here, speaks about its answer.
    """

    task: Task
    name: str = "rule-steps"

    def judge(self, prompt_text: str, completion_text: str) -> str | None:
        check = getattr(self.task, "check_steps", None)
        return None if check is None else check(prompt_text, completion_text)


@torch.no_grad()
def topk_accept(policy: Policy, prompts: list[list[int]], completions: list[list[int]], k: int) -> torch.Tensor:
    """(N,) bool: every token of completion i is among `policy`'s top-k at its position.

    One forward pass over all N completions, padded to the longest; padding never counts (its
    logit is -inf, and positions past a completion's end are masked).
    """
    if not prompts:
        return torch.zeros(0, dtype=torch.bool)
    logits, targets, mask = completion_logits(policy, prompts, completions)
    top = logits.topk(min(k, logits.size(-1)), dim=-1).indices  # (N, T, k)
    hit = (top == targets[..., None]).any(-1)  # (N, T)
    return (hit | ~mask).all(-1)


@dataclass
class Screening:
    """What the checks left of each foreign bundle, and what they cost."""

    kept: list[RolloutBundle]  # each input bundle without its rejected completions
    rejected: list[int]  # per input bundle: completions rejected
    reasons: list[str]  # per input bundle: the first rejection's reason ("" if none)
    seconds: float = 0.0


def screen(
    policy: Policy,
    task: Task,
    tokenizer: PolicyTokenizer,
    prompts: Sequence[Prompt],
    bundles: Sequence[RolloutBundle],
    cfg: DefenseConfig,
    judge: Judge | None = None,
) -> Screening:
    """The same-policy top-k check on completions from peers declaring our model id, then the judge
    on every foreign completion that earns the full reward, whatever its policy: a wrong step behind
    a right answer is the in-context attack, and the rule judge costs nothing to run on all of them.

    `prompts` holds every prompt the bundles' `prompt_index` values refer to (validated bundles only).
    """
    began = time.perf_counter()
    judge = judge or RuleJudge(task)
    by_index = {p.index: p for p in prompts}
    ok: list[list[bool]] = [[True] * len(b.completions) for b in bundles]
    reasons = [""] * len(bundles)
    same = [(j, i) for j, b in enumerate(bundles) if b.model_id == policy.model_id for i in range(len(b.completions))]
    if same:
        rows = [bundles[j].completions[i] for j, i in same]
        accepted = topk_accept(
            policy,
            [tokenizer.encode(by_index[c.prompt_index].text) for c in rows],
            [list(c.tokens) for c in rows],
            cfg.top_k,
        )
        for (j, i), good in zip(same, accepted.tolist(), strict=True):
            if not good:
                ok[j][i] = False
                reasons[j] = reasons[j] or f"completion {i}: a token outside our top-{cfg.top_k}"
    for j, bundle in enumerate(bundles):
        for i, c in enumerate(bundle.completions):
            prompt, text = by_index[c.prompt_index].text, tokenizer.decode(c.tokens)
            if not ok[j][i] or task.reward(prompt, text) < CORRECT_REWARD:
                continue  # only a right answer earns the positive advantage a poisoned working needs
            why = judge.judge(prompt, text)
            if why is not None:
                ok[j][i] = False
                reasons[j] = reasons[j] or f"completion {i}: {judge.name} judge: {why}"
    kept = [
        dataclasses.replace(
            b,
            completions=tuple(c for c, good in zip(b.completions, flags, strict=True) if good),
            claimed_rewards=tuple(r for r, good in zip(b.claimed_rewards, flags, strict=False) if good),
        )
        for b, flags in zip(bundles, ok, strict=True)
    ]
    return Screening(kept, [flags.count(False) for flags in ok], reasons, time.perf_counter() - began)


def length_penalised(rewards: torch.Tensor, lengths: torch.Tensor, canonical: torch.Tensor, slack: int) -> torch.Tensor:
    """Rewards (N,) with every completion longer than canonical + slack tokens cut to zero."""
    return rewards.masked_fill(lengths > canonical + slack, 0.0)


@dataclass
class Strikes:
    """Consecutive failing bundles per peer; a peer reaching `max_strikes` is dropped for good."""

    max_strikes: int = 0
    strike_share: float = 0.5
    counts: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # peer -> the reason of its last failure

    def record(self, peer: str, completions: int, rejected: int, reason: str = "") -> bool:
        """Count one bundle's outcome; True when this bundle got its sender dropped."""
        if peer in self.dropped or self.max_strikes == 0:
            return False
        failed = completions > 0 and rejected >= self.strike_share * completions
        self.counts[peer] = self.counts.get(peer, 0) + 1 if failed else 0
        if self.counts[peer] < self.max_strikes:
            return False
        if len(self.dropped) >= MAX_DROPPED:
            self.dropped.pop(next(iter(self.dropped)))  # forget the oldest; its bundles will strike again
        self.dropped[peer] = reason or f"{rejected} of {completions} completions rejected"
        return True

    def is_dropped(self, peer: str) -> bool:
        return peer in self.dropped
