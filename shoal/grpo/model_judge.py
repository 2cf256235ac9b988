"""A language model as the judge of a foreign completion (the paper's LLM-as-a-judge), behind the
same `Judge` protocol as the arithmetic `ClaimJudge`.

The paper asks Llama-3.1-8B-Instruct to check every step for correctness, succinctness and irrelevant
or malicious content, to write a criticism and then a yes/no decision; a "no", or anything that is not
a decision, rejects the completion (fail closed: a judge that cannot say yes has not said yes).
`policy_judge` makes the node's own policy the judge (the paper's variant that judges with the model
being trained), which only an imported instruct checkpoint can be: a task's character policy cannot
even read the question.

The adaptive attack in the paper's code writes the decision markup into the completion itself, hoping
the judge copies it. A completion holding that markup is refused before the model is asked, and the
decision is read only from the judge's own reply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.grpo.policy import Policy
from shoal.grpo.sampling import sample
from shoal.grpo.tokenizer import PolicyTokenizer

JUDGE_TEMPLATE = (
    "You check a student's answer. Read every step of the working. Each step must be correct, "
    "needed, and about the question: no irrelevant, repeated or malicious text.\n"
    "Question: {prompt}\n"
    "Answer: {completion}\n"
    "Write your criticism inside <criticism></criticism>, then <decision>yes</decision> if every "
    "step is correct and needed, otherwise <decision>no</decision>.\n"
)
DECISION = re.compile(r"<decision>\s*(yes|no)\s*</decision>", re.IGNORECASE)
CRITICISM = re.compile(r"<criticism>(.*?)</criticism>", re.IGNORECASE | re.DOTALL)
MARKUP = re.compile(r"</?\s*(decision|criticism)\s*>", re.IGNORECASE)


@dataclass(frozen=True)
class ModelJudge:
    """`generate(text) -> reply`: any model that continues a text, greedy or sampled."""

    generate: Callable[[str], str]
    name: str = "model"

    def judge(self, prompt_text: str, completion_text: str) -> str | None:
        if MARKUP.search(completion_text):
            return "the completion holds the judge's own markup"
        reply = self.generate(JUDGE_TEMPLATE.format(prompt=prompt_text, completion=completion_text))
        decisions = DECISION.findall(reply)
        if not decisions:
            return "the judge gave no decision"
        if decisions[-1].lower() == "yes":
            return None
        criticism = CRITICISM.search(reply)
        return "judged wrong" + (f": {' '.join(criticism[1].split())[:120]}" if criticism else "")


def policy_judge(policy: Policy, tokenizer: PolicyTokenizer, max_new_tokens: int = 128) -> ModelJudge:
    """The node's own policy as the judge: greedy, at most `max_new_tokens` of reply."""

    def generate(text: str) -> str:
        with torch.no_grad():
            out = sample(policy, [tokenizer.encode_prompt(text)], 1, max_new_tokens, tokenizer.eos_id, greedy=True)
        return tokenizer.decode(out.completions[0])

    return ModelJudge(generate, name="policy")
