"""Verifiable tasks: prompts drawn deterministically from (run seed, round, index), rule-based rewards.

Any node recomputes a prompt from its seed and a reward from the prompt text and the completion
text alone, so no peer ever has to be believed about either. A task is anything with the `Task`
protocol's fields; `TASKS` is the registry a run config names tasks from.

Addition writes its answer's digits reversed (units first), the order in which a left-to-right
decoder can carry as it writes: a 0.3M-parameter decoder learns `47+38=58$` to ~75 % held-out
accuracy in a 25 s warm-up on one CPU thread (benchmarks/grpo.py).

Chat tasks (`chat: True`) are for imported instruct models: the prompt is a question in words, which
the policy's tokenizer wraps in the checkpoint's chat template, and the answer is free text that ends
where the model ends its turn (the template's end token, which task text writes as `$`).
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
    alphabet: str  # every character a prompt or a completion may hold, EOS included ("" : free text)
    max_new_tokens: int  # the longest well-formed completion, EOS included
    chat: bool  # the prompt is a user turn for a chat template, the completion the assistant's reply

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
    chat: bool = False

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
    poisoned working earn the full reward, and why a judge (`check_claims`) exists beside the reward.
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

    def check_claims(self, prompt_text: str, completion_text: str) -> str | None:
        """Why the working's own claims are false or do not lead to its answer, or None.

        Each step claims one column's total, units column first: a bare number (`15`, `08` or `8`) or
        the sum written out (`7+8=15`, `4+3+1=8`; the operands are the column's digits in either order,
        then the carry the previous written step implies, when it is not zero). Every claim is checked
        by arithmetic against the prompt's digits and the carry the working itself implies, not against
        the canonical steps; the answer must be the one the steps add up to. One step past the last
        column may state the final carry (`1`); any other extra step is irrelevant and refused, as the
        paper's judge refuses irrelevant content.
        """
        parts = self.split(completion_text)
        if parts is None:
            return "not a well-formed completion"
        working, answer = parts
        a, b = self.operands(prompt_text)
        written = working.split(";") if working else []
        if not written:
            return "no working"
        carry, digits = 0, []
        for i, step in enumerate(written):
            column = (a // 10**i) % 10, (b // 10**i) % 10
            if i == self.digits:  # past the last column: only the final carry may be stated
                if i != len(written) - 1 or step.lstrip("0") != str(carry) or carry == 0:
                    return f"step {i} {step!r} is past the last column and is not its carry"
                continue
            if i > self.digits:
                return f"step {i} {step!r} is past the last column"
            total = _claimed_total(step, column, carry)
            if isinstance(total, str):
                return f"step {i} {step!r}: {total}"
            if total != column[0] + column[1] + carry:
                return f"step {i} {step!r} claims {total}, but {column[0]}+{column[1]}+{carry} is {sum(column) + carry}"
            carry, digit = divmod(total, 10)
            digits.append(digit)
        if len(digits) < self.digits:
            return f"{len(digits)} steps for {self.digits} columns"
        implied = sum(d * 10**i for i, d in enumerate(digits)) + carry * 10**self.digits
        if answer != implied:
            return f"the answer {answer} does not follow from the working ({implied})"
        return None


def _claimed_total(step: str, column: tuple[int, int], carry: int) -> int | str:
    """The total a step claims for a column with these digits and incoming carry, or why it claims none."""
    bare = re.fullmatch(r"\d{1,2}", step)
    if bare is not None:
        return int(step)
    equation = re.fullmatch(r"(\d)\+(\d)(?:\+(\d))?=(\d{1,2})", step)
    if equation is None:
        return "not a column total"
    x, y, c, total = int(equation[1]), int(equation[2]), int(equation[3] or 0), int(equation[4])
    if sorted((x, y)) != sorted(column):
        return f"adds {x} and {y}, the column's digits are {column[0]} and {column[1]}"
    if c != carry:
        return f"carries {c}, the step before implies {carry}"
    if x + y + c != total:
        return f"{x}+{y}+{c} is not {total}"
    return total


@dataclass(frozen=True)
class ChatArithmetic:
    """`What is 47 + 38?` for a chat model, answered in free text; the answer is the last number the
    reply writes before it ends (`The sum is 85.` answers 85; commas inside a number are read through).

    Operands have exactly `digits` digits (one-digit ones may be 0); about a tenth of the operand
    pairs, chosen by a hash, are held out for evaluation, as in `Addition`. `terms` numbers are added.
    """

    name: str
    digits: int
    terms: int = 2
    max_new_tokens: int = 24  # room for a short sentence around the number, the end token included
    alphabet: str = ""  # free text: no character-level policy can take this task
    chat: bool = True

    def split_of(self, numbers: tuple[int, ...]) -> str:
        return EVAL if task_seed("chat-split", self.digits, *numbers) % 10 == 0 else TRAIN

    def prompt(self, seed: int, round: int, index: int, split: str = TRAIN) -> Prompt:
        rng = random.Random(task_seed(seed, self.name, split, round, index))
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        while True:
            numbers = tuple(rng.randrange(low, 10**self.digits) for _ in range(self.terms))
            if self.split_of(numbers) == split:
                question = " + ".join(map(str, numbers))
                return Prompt(self.name, round, index, f"What is {question}? Answer with the number.")

    def numbers(self, prompt_text: str) -> tuple[int, ...]:
        match = re.fullmatch(r"What is (\d+(?: \+ \d+)+)\? Answer with the number\.", prompt_text)
        if match is None:
            raise ValueError(f"{prompt_text!r} is not a {self.name} prompt")
        return tuple(int(n) for n in match[1].split(" + "))

    def demonstration(self, prompt_text: str) -> str:
        return f"{sum(self.numbers(prompt_text))}{EOS}"

    def reward(self, prompt_text: str, completion_text: str) -> float:
        """1 for a reply that ends and whose last number is the sum, 0.1 for one that ends with another
        number, 0 for a reply cut off by the length budget or with no number."""
        answer = read_last_number(completion_text)
        if answer is None:
            return 0.0
        return CORRECT_REWARD if answer == sum(self.numbers(prompt_text)) else FORMAT_REWARD


def read_last_number(completion_text: str) -> int | None:
    """The last number in a reply that ended (its text ends with EOS), or None: a cut-off reply
    answers nothing, whatever it wrote."""
    if not completion_text.endswith(EOS):
        return None
    found = re.findall(r"-?\d+(?:,\d{3})*", completion_text[: -len(EOS)])
    return int(found[-1].replace(",", "")) if found else None


TASKS: dict[str, Task] = {
    "add2r": Addition("add2r", digits=2),
    "add2r-steps": AdditionSteps("add2r-steps", digits=2),  # working shown: the poisoning experiments' task
    "add3r": Addition("add3r", digits=3),  # out of distribution for a policy trained on add2r
    # for imported instruct models (a chat template): one-, two- and three-digit sums, and three terms
    "chat-add1": ChatArithmetic("chat-add1", digits=1),
    "chat-add2": ChatArithmetic("chat-add2", digits=2),
    "chat-add3": ChatArithmetic("chat-add3", digits=3),
    "chat-add2x3": ChatArithmetic("chat-add2x3", digits=2, terms=3),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]
