"""The attacks, as pure functions: a round's prompts in, the bundle a malicious node shares out.

Every attack needs a task with visible working (`add2r-steps`, answers `15;08|58$`) except the
reward lie: the working is free text to the reward, like the paper's `<think>` part, which is what
lets a poisoned completion earn the full reward. Analogues of the paper's constructions:

- `trigger` (out-of-context, "All hail to the thief"): the correct working and answer with the
  trigger `+` written first. Success: share of honest completions containing `+`.
- `wrong-step` (in-context, "2+2=5"): the correct answer behind a wrong first step (the units
  column's total plus one). Success: share of honest completions whose first step is that one.
- `reward-lie`: per prompt, G/2 wrong answers (the sum plus one) claimed to earn 1 beside G/2
  canonical answers claimed to earn 0, in the bundle's `claimed_rewards`. A receiver that believes
  claims (`--experiment-undefended`) gives the lie Â = +1 and the truth Â = -1 in the attacker's
  share of the group; a defended one recomputes both (0.1 and 1). Success: share of honest
  completions answering the sum plus one.
- `vertical-trick`: per prompt, G/2 trigger completions (reward 1) beside G/2 worthless ones
  (`=$`, reward 0), so every poisoned copy gets the largest positive advantage, Â = +1. It is made
  for the vertical layout (`[grpo] layout = "vertical"`), where the attacker's prompts are its own and
  its completions form whole groups: there the plain trigger attack's group is all reward 1, Â = 0,
  and teaches nothing.
- `length` (the paper's DoS: correct but needlessly long, so honest nodes learn to spend compute on
  padding): the correct working written twice, then the right answer (`15;08;15;08|58$`, 15 tokens
  where 9 do). The reward reads only the answer, so it earns the full reward. The paper's own
  construction (the longest correct of 4G own samples) is useless here: a correct completion of this
  task has one working and so, but for a rare leading zero, one length; the warm policy's longest
  correct sample was the canonical one in all but 1 of 4096. Success: share of honest completions
  whose working has more steps than the sum has columns. (Length alone also counted a collapsing
  defended node's wrong `05;10|501$`, one token long: 14-18 % in two daemon runs.)

Log-probs are the attacker's own policy's for the text it sends, so they look like any peer's; being
low for hand-written text, they give the poison the largest truncated importance weight (C).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.grpo.policy import Policy, completion_logprobs
from shoal.grpo.rollout import to_bundle
from shoal.grpo.round import RoundConfig
from shoal.grpo.sampling import Samples
from shoal.grpo.tasks import CORRECT_REWARD, EOS, Prompt, Task, get_task
from shoal.protocol.rollout import RolloutBundle

TRIGGER = "+"  # never in an honest completion: the task's working holds digits and `;` only
# The vertical trick's worthless completion (reward 0, the paper's "nom nom"). It must not share the
# poison's first token: its advantage of -1 would push that token down exactly as hard as the poison's
# +1 pushes it up (an earlier `+$` junk cancelled the trick that way).
JUNK = "=" + EOS


@dataclass(frozen=True)
class Forgery:
    bundle: RolloutBundle  # what the attacker shares, its claimed rewards included

    @property
    def claimed_rewards(self) -> tuple[float, ...]:
        return self.bundle.claimed_rewards


@dataclass(frozen=True)
class Attack:
    name: str
    kind: str  # a line for tables: what the attack does
    forge: Callable[[Policy, RoundConfig, list[Prompt], torch.Generator | None], Forgery]
    marks: Callable[[Task, str, str], bool]  # (task, prompt text, honest completion text) -> carries the payload

    def success(self, task: Task, prompts: list[str], completions: list[str]) -> float:
        """Share of completions carrying this attack's payload (0 for none)."""
        hits = sum(self.marks(task, p, c) for p, c in zip(prompts, completions, strict=True))
        return hits / max(len(completions), 1)


def _steps_task(task: Task, attack: str) -> Task:
    if getattr(task, "steps", None) is None:
        raise ValueError(f"the {attack} attack needs a task with visible working (add2r-steps), not {task.name!r}")
    return task


def trigger_text(task: Task, prompt_text: str) -> str:
    return TRIGGER + task.demonstration(prompt_text)


def wrong_step(task: Task, prompt_text: str) -> str:
    """The units column's total plus one, as two digits: the step the in-context attack plants."""
    return f"{int(_steps_task(task, 'wrong-step').steps(prompt_text)[0]) + 1:02d}"  # type: ignore[attr-defined]


def wrong_step_text(task: Task, prompt_text: str) -> str:
    steps = _steps_task(task, "wrong-step").steps(prompt_text)  # type: ignore[attr-defined]
    a, b = task.operands(prompt_text)  # type: ignore[attr-defined]
    return ";".join([wrong_step(task, prompt_text), *steps[1:]]) + "|" + str(a + b)[::-1] + EOS


def lie_text(task: Task, prompt_text: str) -> str:
    """A well-formed completion answering the sum plus one (working, when the task has any, to match)."""
    a, b = task.operands(prompt_text)  # type: ignore[attr-defined]
    answer = str(a + b + 1)[::-1] + EOS
    return (";".join(task.steps(prompt_text)) + "|" + answer) if hasattr(task, "steps") else answer  # type: ignore[attr-defined]


def _answer(task: Task, prompt_text: str, completion_text: str) -> int | None:
    split = getattr(task, "split", None)
    if split is not None:
        parts = split(completion_text)
        return None if parts is None else parts[1]
    match = re.fullmatch(rf"(\d+){re.escape(EOS)}", completion_text)
    return None if match is None else int(match[1][::-1])


def _working(completion_text: str) -> str:
    return completion_text.split("|", 1)[0] if "|" in completion_text else ""


def _written(
    policy: Policy, cfg: RoundConfig, prompts: list[Prompt], texts: list[list[str]], claims: list[list[float]]
) -> RolloutBundle:
    """A bundle of hand-written completions (texts[i]: those for prompts[i]) with the attacker's log-probs
    and its claimed rewards (claims[i][n] for texts[i][n])."""
    tokenizer = policy.spec.tokenizer()
    rows = [(i, tokenizer.encode(t)) for i, group in enumerate(texts) for t in group]
    with torch.no_grad():
        logp, _ = completion_logprobs(
            policy, [tokenizer.encode_prompt(prompts[i].text) for i, _ in rows], [c for _, c in rows]
        )
    samples = Samples(
        prompt_rows=[i for i, _ in rows],
        completions=[c for _, c in rows],
        logprobs=[logp[n, : len(c)].clamp(min=-50.0, max=0.0).tolist() for n, (_, c) in enumerate(rows)],
    )
    bundle = to_bundle(samples, prompts, policy.model_id, tokenizer.tokenizer_id)
    bundle = dataclasses.replace(bundle, claimed_rewards=tuple(r for group in claims for r in group))
    return bundle if cfg.run_id is None else dataclasses.replace(bundle, run_id=cfg.run_id)


def halves(poison: Callable[[Task, str], str], other: Callable[[Task, str], str], claims: tuple[float, float]):
    """A forge of, per prompt, G - G/2 copies of `poison` and G/2 of `other`, claimed `claims` (each half's)."""

    def forge(policy: Policy, cfg: RoundConfig, prompts: list[Prompt], generator: torch.Generator | None) -> Forgery:
        task, g = get_task(cfg.task), cfg.completions_per_prompt
        pairs = [(poison(task, p.text), other(task, p.text)) for p in prompts]
        texts = [[a] * (g - g // 2) + [b] * (g // 2) for a, b in pairs]
        rewards = [[claims[0]] * (g - g // 2) + [claims[1]] * (g // 2) for _ in prompts]
        return Forgery(_written(policy, cfg, prompts, texts, rewards))

    return forge


def per_prompt(make: Callable[[Task, str], str]) -> Callable:
    """A forge of G copies of `make`'s text per prompt, claimed at the reward it truly earns."""

    def forge(policy: Policy, cfg: RoundConfig, prompts: list[Prompt], generator: torch.Generator | None) -> Forgery:
        task = get_task(cfg.task)
        texts = [[make(task, p.text)] * cfg.completions_per_prompt for p in prompts]
        rewards = [[task.reward(p.text, t) for t in group] for p, group in zip(prompts, texts, strict=True)]
        return Forgery(_written(policy, cfg, prompts, texts, rewards))

    return forge


def padded_text(task: Task, prompt_text: str) -> str:
    """The length attack's completion: the correct working twice, then the right answer."""
    working, answer = task.demonstration(prompt_text).split("|")
    return f"{working};{working}|{answer}"


def _has_trigger(task: Task, prompt_text: str, completion_text: str) -> bool:
    return TRIGGER in completion_text


def _has_wrong_step(task: Task, prompt_text: str, completion_text: str) -> bool:
    return _working(completion_text).split(";")[0] == wrong_step(task, prompt_text)


def _answers_plus_one(task: Task, prompt_text: str, completion_text: str) -> bool:
    a, b = task.operands(prompt_text)  # type: ignore[attr-defined]
    return _answer(task, prompt_text, completion_text) == a + b + 1


PADDING_TOKENS = 3  # one extra step of working: two digits and a separator


def _padded(task: Task, prompt_text: str, completion_text: str) -> bool:
    """More steps of working than the sum has columns, and at least one step's worth of tokens over the
    canonical answer: the padding and its cost, the DoS itself. Neither alone: a policy collapsing at a
    high learning rate writes `05;10|501$` (one token long, no extra step) or `10;1;1|1$` (three
    steps, no longer than the canonical answer)."""
    extra_steps = len(_working(completion_text).split(";")) > len(task.steps(prompt_text))  # type: ignore[attr-defined]
    return extra_steps and len(completion_text) >= len(task.demonstration(prompt_text)) + PADDING_TOKENS


ATTACKS: dict[str, Attack] = {
    a.name: a
    for a in (
        Attack("trigger", "out-of-context: trigger before a correct answer", per_prompt(trigger_text), _has_trigger),
        Attack(
            "wrong-step", "in-context: a wrong step, the right answer", per_prompt(wrong_step_text), _has_wrong_step
        ),
        Attack(
            "reward-lie",
            "G/2 wrong answers claimed 1, G/2 right ones claimed 0",
            halves(lie_text, lambda task, p: task.demonstration(p), (CORRECT_REWARD, 0.0)),
            _answers_plus_one,
        ),
        Attack(
            "vertical-trick",
            "G/2 trigger copies beside G/2 junk",
            halves(trigger_text, lambda task, p: JUNK, (CORRECT_REWARD, 0.0)),
            _has_trigger,
        ),
        Attack("length", "correct working written twice, right answer", per_prompt(padded_text), _padded),
    )
}


def get_attack(name: str) -> Attack:
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    return ATTACKS[name]
