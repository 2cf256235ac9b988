"""Verifiable tasks: prompts drawn deterministically from (run seed, round, index), rule-based rewards.

Any node recomputes a prompt from its seed and a reward from the prompt text and the completion
text alone, so no peer ever has to be believed about either. A task is anything with the `Task`
protocol's fields; `TASKS` is the registry a run config names tasks from.

Addition writes its answer's digits reversed (units first), the order in which a left-to-right
decoder can carry as it writes: a 0.3M-parameter decoder learns `47+38=58$` to ~75 % held-out
accuracy in a 25 s warm-up on one CPU thread (benchmarks/grpo.py).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Protocol

from shoal.grpo.tokenizer import EOS

TRAIN, EVAL = "train", "eval"
CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1  # a well-formed wrong answer: enough to keep groups of all-wrong samples apart


@dataclass(frozen=True)
class Prompt:
    task: str
    round: int
    index: int
    text: str


class Task(Protocol):
    name: str
    alphabet: str  # every character a prompt or a completion may hold, EOS included
    max_new_tokens: int  # the longest well-formed completion, EOS included

    def prompt(self, seed: int, round: int, index: int, split: str = TRAIN) -> Prompt: ...

    def demonstration(self, prompt_text: str) -> str:
        """The canonical correct completion (supervised warm-up data)."""
        ...

    def reward(self, prompt_text: str, completion_text: str) -> float: ...


def task_seed(*labels: object) -> int:
    """A stable seed from labels (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, labels)).encode()).digest()[:8], "little")


@dataclass(frozen=True)
class Addition:
    """`a+b=` with zero-padded `digits`-digit operands; the answer is the sum's digits reversed, then `$`.

    About a tenth of all operand pairs (chosen by a hash) form the held-out split: training prompts
    never show them, evaluation prompts are drawn only from them.
    """

    name: str
    digits: int
    alphabet: str = "0123456789+=" + EOS

    @property
    def max_new_tokens(self) -> int:
        return self.digits + 2  # the sum has at most digits + 1 digits, then EOS

    def split_of(self, a: int, b: int) -> str:
        return EVAL if task_seed("split", self.digits, a, b) % 10 == 0 else TRAIN

    def prompt(self, seed: int, round: int, index: int, split: str = TRAIN) -> Prompt:
        rng = random.Random(task_seed(seed, self.name, split, round, index))
        high = 10**self.digits
        while True:  # ~10 draws on average for the held-out split, 1.1 for training
            a, b = rng.randrange(high), rng.randrange(high)
            if self.split_of(a, b) == split:
                return Prompt(self.name, round, index, f"{a:0{self.digits}d}+{b:0{self.digits}d}=")

    def operands(self, prompt_text: str) -> tuple[int, int]:
        match = re.fullmatch(rf"(\d{{{self.digits}}})\+(\d{{{self.digits}}})=", prompt_text)
        if match is None:
            raise ValueError(f"{prompt_text!r} is not a {self.name} prompt")
        return int(match[1]), int(match[2])

    def demonstration(self, prompt_text: str) -> str:
        a, b = self.operands(prompt_text)
        return str(a + b)[::-1] + EOS

    def reward(self, prompt_text: str, completion_text: str) -> float:
        """1 for the canonical answer, 0.1 for a well-formed wrong one, 0 for anything else."""
        if completion_text == self.demonstration(prompt_text):
            return CORRECT_REWARD
        return FORMAT_REWARD if parse_reversed_answer(completion_text, self.digits + 1) is not None else 0.0


def parse_reversed_answer(completion_text: str, max_digits: int) -> int | None:
    """The number a completion answers (digits written units first, then EOS), or None if malformed."""
    match = re.fullmatch(rf"(\d{{1,{max_digits}}}){re.escape(EOS)}", completion_text)
    return None if match is None else int(match[1][::-1])


@dataclass(frozen=True)
class AdditionSteps(Addition):
    """`a+b=` answered with its working shown: `<steps>|<sum reversed>$`, e.g. `47+38=15;08|58$`.

    Each step is one column's total, units column first, as two digits (carry out, digit): 7+8 = 15,
    then 4+3+1 = 08. Like the paper's `<think>` part, the working is free text to the reward, which
    checks only the answer after the single `|` (format and correctness): that is what lets a
    poisoned working earn the full reward, and why a judge (`check_steps`) exists beside the reward.
    """

    alphabet: str = "0123456789+=;|" + EOS
    slack_tokens: int = 6  # room for working longer than the canonical one (what an attack may use)

    @property
    def max_new_tokens(self) -> int:
        return len(self.demonstration("9" * self.digits + "+" + "9" * self.digits + "=")) + self.slack_tokens

    def steps(self, prompt_text: str) -> list[str]:
        a, b = self.operands(prompt_text)
        carry, out = 0, []
        for i in range(self.digits):
            total = (a // 10**i) % 10 + (b // 10**i) % 10 + carry
            out.append(f"{total:02d}")
            carry = total // 10
        return out

    def demonstration(self, prompt_text: str) -> str:
        a, b = self.operands(prompt_text)
        return ";".join(self.steps(prompt_text)) + "|" + str(a + b)[::-1] + EOS

    def split(self, completion_text: str) -> tuple[str, int] | None:
        """(working, answer) of a well-formed completion, or None."""
        match = re.fullmatch(rf"([^|{re.escape(EOS)}]*)\|(\d{{1,{self.digits + 1}}}){re.escape(EOS)}", completion_text)
        return None if match is None else (match[1], int(match[2][::-1]))

    def reward(self, prompt_text: str, completion_text: str) -> float:
        """1 for a well-formed completion with the right answer (whatever its working), 0.1 for a wrong one."""
        parts = self.split(completion_text)
        if parts is None:
            return 0.0
        a, b = self.operands(prompt_text)
        return CORRECT_REWARD if parts[1] == a + b else FORMAT_REWARD

    def check_steps(self, prompt_text: str, completion_text: str) -> str | None:
        """Why the working is not exactly the correct steps (a wrong, missing or extra step), or None."""
        parts = self.split(completion_text)
        if parts is None:
            return "not a well-formed completion"
        expected, written = self.steps(prompt_text), parts[0].split(";")
        if len(written) != len(expected):
            return f"{len(written)} steps, expected {len(expected)}"
        for i, (w, e) in enumerate(zip(written, expected, strict=True)):
            if w != e:
                return f"step {i} reads {w!r}, the column total is {e}"
        return None


TASKS: dict[str, Task] = {
    "add2r": Addition("add2r", digits=2),
    "add2r-steps": AdditionSteps("add2r-steps", digits=2),  # working shown: the poisoning experiments' task
    "add3r": Addition("add3r", digits=3),  # out of distribution for a policy trained on add2r
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]
