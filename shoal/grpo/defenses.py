"""Defenses against poisoned rollouts (Hail to the Thief, grpo_attacks.md): checks a receiver runs
on every foreign completion before it joins a group, and a strike count that drops a bad source.
Each check is switched on or off by itself (`DefenseConfig`), so each can be measured alone.

- Rewards are never read from a bundle: `build_batch` scores every completion from the prompt this
  node derived itself, and a bundle's `claimed_rewards` are ignored (only an experiment's undefended
  node, `DefenseConfig(enabled=False)`, believes them: `shoal.grpo.round.learn`).
- Same policy (the bundle's model id is this node's): every token of a foreign completion must be
  among the receiver's own top-k predictions at its position, for all completions in one batched
  forward pass (`topk_accept`). The paper samples top-50 and checks top-100 over a ~150k vocabulary;
  here the vocabulary has 16 ids, honest nodes sample from the top 4 and the check keeps the top 6
  (k_v > k_g absorbs the drift between two nodes' weights after a few rounds apart). Hand-written
  text, like a trigger phrase, almost surely leaves the top 6.
- A judge reads the working of every completion that earns the full reward: a foreign one it refuses
  is dropped before it joins a group, one of the node's own earns nothing (`judged_rewards`). Judging
  only foreign work left a hole: at a high learning rate a defended node's own policy drifted into
  padded or slipped workings with a right answer (seen: 28 % padded by round 26 with nothing foreign
  used), which GRPO rewarded wherever the padded answer was its group's only right one.
  The paper asks Llama-3.1-8B-Instruct whether every step is correct and relevant; `ClaimJudge`
  checks each step's own claim by arithmetic (the task's `check_claims`: a column total, in any of
  the forms it names, true for the prompt's digits and the carry the working itself implies, and an
  answer that follows from the steps). It does not compare with the canonical working, so honest workings in other forms
  pass. `ModelJudge` asks a language model instead, through the same `Judge` protocol.
- Length (the paper's DoS, which neither of its checks stops: correct but needlessly long answers):
  a completion longer than `1 + length_excess` times its reference length earns nothing, right or
  wrong (`group_length_penalised`). The reference is the shortest correct completion in its group or
  the 90th percentile of the lengths of the node's own last `length_memory` rewarded right answers to
  prompts of the same length (`LengthMemory`), whichever is shorter; the memory is set aside in a
  group where the node itself answered right (so a right answer longer than the ones remembered
  can still earn, and be remembered). Neither needs a canonical length, so the rule
  holds on tasks where right answers vary in length. The memory is there because within one group a
  right answer that only the attacker wrote sets the bar itself (seen: with a weak policy and the
  group rule alone, padding reached 96 % of a node's completions); it learns only from the node's
  own answers that the rule let earn, so padding cannot move it. Applied to every completion, own
  included, as part of the reward: an over-long answer gets the group's lowest reward and a
  non-positive advantage. Cutting only correct answers would leave padding level with a well-formed
  wrong answer (seen: an undefended peer's padded wrong answers outscored malformed ones in a
  defended node's groups). What it cannot see: padding on a prompt length for which the node has no
  right answer of its own yet (the first round, or a prompt unlike the ones before) and nobody but
  the attacker answered right. What it costs: an honest answer in a longer form than the shortest
  known (the task's `7+8=15` steps beside `15`) earns nothing; and on tasks whose right answers'
  lengths do not follow the prompt's, the memory is a poor guide (`length_memory = 0` turns it off).
- `Strikes`: a peer whose bundles keep failing (at least `strike_share` of a bundle rejected,
  `max_strikes` times in a row) is dropped from the node's sources for the rest of the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shoal.grpo.model_judge import policy_judge
from shoal.grpo.policy import Policy, completion_logits
from shoal.grpo.tasks import CORRECT_REWARD, Prompt, Task
from shoal.grpo.tokenizer import PolicyTokenizer
from shoal.protocol.rollout import RolloutBundle

MAX_DROPPED = 16  # sources a node remembers (and advertises) as dropped


@dataclass(frozen=True)
class DefenseConfig:
    enabled: bool = True  # off only in experiments (benchmarks/attacks.py, --experiment runs)
    top_k: int = 6  # k_v: a same-policy completion's tokens must all be in the receiver's top k; 0: no check
    judge: str = "claims"  # on full-reward foreign completions: "claims" (ClaimJudge), "policy", or "none"
    length_rule: bool = True  # the group-relative length budget
    length_excess: float = 0.25  # share over the reference length that still earns
    length_memory: int = 256  # own rewarded right answers remembered per prompt length; 0: the group alone
    max_strikes: int = 0  # failing bundles in a row before their sender is dropped; 0: never
    strike_share: float = 0.5  # a bundle fails when at least this share of its completions is rejected


class Judge(Protocol):
    """Reads one completion's working; the paper's LLM judge or a rule-based stand-in."""

    name: str

    def judge(self, prompt_text: str, completion_text: str) -> str | None:
        """The reason to reject the completion, or None to accept it."""
        ...


@dataclass(frozen=True)
class ClaimJudge:
    """Checks the working's own arithmetic claims (the task's `check_claims`), not its form.

    A task without visible working (plain `add2r`) has nothing to judge: every completion passes,
    and only the reward, recomputed here, speaks about its answer.
    """

    task: Task
    name: str = "claims"

    def judge(self, prompt_text: str, completion_text: str) -> str | None:
        check = getattr(self.task, "check_claims", None)
        return None if check is None else check(prompt_text, completion_text)


def make_judge(kind: str, task: Task, policy: Policy, tokenizer: PolicyTokenizer) -> Judge | None:
    """The judge `DefenseConfig.judge` names ("claims", "policy": shoal.grpo.model_judge, "none": no judge)."""
    if kind == "claims":
        return ClaimJudge(task)
    if kind == "policy":
        return policy_judge(policy, tokenizer)
    if kind == "none":
        return None
    raise ValueError(f"unknown judge {kind!r}; known: claims, policy, none")


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
    a right answer is the in-context attack. Either is skipped where `cfg` switches it off.

    `prompts` holds every prompt the bundles' `prompt_index` values refer to (validated bundles only).
    """
    began = time.perf_counter()
    if judge is None:
        judge = make_judge(cfg.judge, task, policy, tokenizer)
    by_index = {p.index: p for p in prompts}
    ok: list[list[bool]] = [[True] * len(b.completions) for b in bundles]
    reasons = [""] * len(bundles)
    same = [
        (j, i)
        for j, b in enumerate(bundles)
        if cfg.top_k > 0 and b.model_id == policy.model_id
        for i in range(len(b.completions))
    ]
    if same:
        rows = [bundles[j].completions[i] for j, i in same]
        accepted = topk_accept(
            policy,
            [tokenizer.encode_prompt(by_index[c.prompt_index].text) for c in rows],
            [list(c.tokens) for c in rows],
            cfg.top_k,
        )
        for (j, i), good in zip(same, accepted.tolist(), strict=True):
            if not good:
                ok[j][i] = False
                reasons[j] = reasons[j] or f"completion {i}: a token outside our top-{cfg.top_k}"
    for j, bundle in enumerate(bundles if judge is not None else ()):
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


def judged_rewards(rewards: torch.Tensor, texts: Sequence[tuple[str, str]], judge: Judge) -> torch.Tensor:
    """Rewards (N,) with every full-reward completion whose working `judge` refuses cut to zero;
    `texts[i]` is row i's (prompt, completion). A process check on the node's own rollouts: the
    answer alone no longer earns the reward, the working that reaches it must hold too."""
    refused = [
        r >= CORRECT_REWARD and judge.judge(*text) is not None for r, text in zip(rewards.tolist(), texts, strict=True)
    ]
    return rewards.masked_fill(torch.tensor(refused, dtype=torch.bool), 0.0)


def group_length_penalised(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    groups: torch.Tensor,
    excess: float,
    remembered: torch.Tensor | None = None,
    own: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rewards (N,) with every completion longer than (1 + excess) x its reference length cut to zero,
    right or wrong. The reference is its group's shortest fully correct completion or, where given,
    `remembered` (N,): the length the node's own right answers to such prompts had (`LengthMemory`;
    0 where it has none), whichever is shorter. A row with neither is left as is.

    `own` (N,) marks the rows the node wrote itself. A group holding one of the node's own right
    answers sets the memory aside: that answer shows what a right answer to this prompt takes. Without
    this the memory locks in: a node that had only been right on sums under 100 remembers 3 tokens,
    cuts every right 4-token sum (4 > 3 x 1.25), never rewards one, so never remembers one (seen: a
    node of three stuck at 19 % over 24 rounds while the other two reached 48 %)."""
    correct = rewards >= CORRECT_REWARD
    size = int(groups.max()) + 1 if len(groups) else 0
    unbounded = torch.iinfo(torch.long).max
    shortest = torch.full((size,), unbounded, dtype=torch.long)
    shortest = shortest.scatter_reduce(0, groups[correct], lengths[correct].long(), reduce="amin")
    reference = shortest[groups]
    if remembered is not None:
        bound = remembered.long().masked_fill(remembered <= 0, unbounded)
        if own is not None:
            answered = torch.zeros(size, dtype=torch.bool).index_fill(0, groups[correct & own], True)
            bound = bound.masked_fill(answered[groups], unbounded)
        reference = torch.minimum(reference, bound)
    return rewards.masked_fill(lengths.double() > reference.double() * (1.0 + excess), 0.0)


@dataclass
class LengthMemory:
    """The lengths of this node's own right answers that kept their reward, per prompt length, over
    the last `window` of each: the length rule's memory of what a right answer takes. Within one
    round's group a right answer that only the attacker wrote sets the bar itself; the memory does
    not move unless the node's own rewarded answers grow, which the rule it feeds keeps them from."""

    window: int = 256
    quantile: float = 0.9  # not the median: same-length prompts' right answers vary (`58$` and `891$`)
    seen: dict[int, deque[int]] = field(default_factory=dict)

    def reference(self, prompt_lengths: Sequence[int]) -> torch.Tensor:
        """The remembered length per row: the `quantile` of its prompt length's window (0: none yet)."""
        known = {key: sorted(self.seen[key]) for key in set(prompt_lengths) if self.seen.get(key)}
        at = {key: lengths[int(self.quantile * (len(lengths) - 1))] for key, lengths in known.items()}
        return torch.tensor([at.get(key, 0) for key in prompt_lengths], dtype=torch.long)

    def record(self, prompt_lengths: Sequence[int], lengths: Sequence[int]) -> None:
        if self.window == 0:
            return
        for key, length in zip(prompt_lengths, lengths, strict=True):
            self.seen.setdefault(key, deque(maxlen=self.window)).append(length)


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
