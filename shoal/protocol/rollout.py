"""GRPO rollouts on the wire: completions as token ids with per-token log-probs, and their validator.

A bundle carries no prompt text: the receiver regenerates each prompt from (run seed, round, prompt
index) and scores every completion itself, so a peer can lie about neither. It may carry the
sender's *claimed* rewards, one per completion (honest nodes send the rewards they computed): a
defended receiver never reads them; they exist so that the naive receiver of Hail to the Thief, which
believes them, can be run as an experiment (`--experiment-undefended`). What a bundle carries (token
ids, log-probs under the policy that sampled them, that policy's model id and tokenizer id, the claims)
is checked by `validate_bundle` against the receiver's own round before any of it reaches a tensor.
About 10 bytes per token (a small int and a float64), as in F-TIS's ~8, plus 9 bytes per claim.

Compatibility: the field came with protocol version 6, so peers of version 5 refuse the envelope
before any field is read; within version 6 a bundle without `claimed_rewards` decodes to no claims.

The schema bounds what a decoder accepts at all (and the codec refuses any message over
``MAX_MESSAGE_BYTES`` before parsing it); the run's own, much smaller, bounds come in ``RolloutLimits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import MalformedMessage
from .registry import message
from .schema import wire_field

MAX_ID_CHARS = 96
MAX_COMPLETION_TOKENS = 32
MAX_BUNDLE_COMPLETIONS = 256
MAX_BUNDLE_TOKENS = 4096  # over all completions: 4096 x ~10 bytes + 256 x ~40 bytes of framing < 64 KiB


class BadRollout(MalformedMessage):
    """A bundle that decodes but cannot be used: wrong round or tokenizer, bad tokens or log-probs."""


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    tokens: tuple[int, ...] = wire_field(max_len=MAX_COMPLETION_TOKENS)
    logprobs: tuple[float, ...] = wire_field(max_len=MAX_COMPLETION_TOKENS)  # ℓg per token, finite


@message("rollouts")
class RolloutBundle:
    """One node's completions for the prompts of one round."""

    task: str = wire_field(max_len=MAX_ID_CHARS)
    round: int
    model_id: str = wire_field(max_len=MAX_ID_CHARS)  # the generating policy (PolicySpec.model_id)
    tokenizer_id: str = wire_field(max_len=MAX_ID_CHARS)
    completions: tuple[Completion, ...] = wire_field(max_len=MAX_BUNDLE_COMPLETIONS)
    run_id: str = wire_field(max_len=MAX_ID_CHARS, default="")  # the run it was sampled for ("": unstated)
    # The sender's rewards per completion, in order (empty: no claim). Never read by a defended node.
    claimed_rewards: tuple[float, ...] = wire_field(max_len=MAX_BUNDLE_COMPLETIONS, default=())


@dataclass(frozen=True)
class RolloutLimits:
    """What the receiver expects this round (from its run config and its own tokenizer)."""

    task: str
    round: int
    tokenizer_id: str
    vocab_size: int  # token ids must lie in first_token..vocab_size-1
    eos_id: int
    prompts: int  # prompt indices must lie in 0..prompts-1
    max_new_tokens: int
    max_per_prompt: int  # completions one peer may send for one prompt
    max_completions: int = MAX_BUNDLE_COMPLETIONS
    max_tokens: int = MAX_BUNDLE_TOKENS  # over all completions of the bundle
    run_id: str | None = None  # when set, a bundle must name this run
    first_token: int = 1  # the character tokenizer's 0 is padding; a checkpoint's tokenizer starts at 0
    max_reward: float = 1.0  # claimed rewards must lie in 0..max_reward (the task's full reward)


def validate_bundle(bundle: RolloutBundle, limits: RolloutLimits) -> None:
    """Raise `BadRollout` with a reason a peer can act on, or return for a bundle that is safe to use.

    A completion ends at its first EOS or at `max_new_tokens`; anything after an EOS, padding, an
    empty completion, a log-prob that is positive or not finite, or claimed rewards that are not one
    number in 0..`max_reward` per completion are refused. Bundles are refused as
    a whole: a peer that sends one bad completion is not trusted for the rest of the bundle.
    """
    if limits.run_id is not None and bundle.run_id != limits.run_id:
        raise BadRollout(f"bundle is for run {bundle.run_id!r}, this is run {limits.run_id!r}")
    if bundle.task != limits.task:
        raise BadRollout(f"bundle is for task {bundle.task!r}, this round is {limits.task!r}")
    if bundle.round != limits.round:
        raise BadRollout(f"bundle is for round {bundle.round}, this is round {limits.round}")
    if bundle.tokenizer_id != limits.tokenizer_id:
        raise BadRollout(f"tokenizer {bundle.tokenizer_id!r} differs from ours ({limits.tokenizer_id!r})")
    if len(bundle.completions) > limits.max_completions:
        raise BadRollout(f"{len(bundle.completions)} completions, over the limit of {limits.max_completions}")
    tokens = sum(len(c.tokens) for c in bundle.completions)
    if tokens > limits.max_tokens:
        raise BadRollout(f"{tokens} tokens in the bundle, over the limit of {limits.max_tokens}")
    per_prompt: dict[int, int] = {}
    for i, c in enumerate(bundle.completions):
        where = f"completion {i}"
        if not 0 <= c.prompt_index < limits.prompts:
            raise BadRollout(f"{where}: prompt index {c.prompt_index} outside 0..{limits.prompts - 1}")
        per_prompt[c.prompt_index] = per_prompt.get(c.prompt_index, 0) + 1
        if per_prompt[c.prompt_index] > limits.max_per_prompt:
            raise BadRollout(f"more than {limits.max_per_prompt} completions for prompt {c.prompt_index}")
        if not 1 <= len(c.tokens) <= limits.max_new_tokens:
            raise BadRollout(f"{where}: {len(c.tokens)} tokens, expected 1..{limits.max_new_tokens}")
        if len(c.logprobs) != len(c.tokens):
            raise BadRollout(f"{where}: {len(c.logprobs)} log-probs for {len(c.tokens)} tokens")
        for token in c.tokens:
            if not limits.first_token <= token < limits.vocab_size:
                raise BadRollout(
                    f"{where}: token id {token} outside the vocabulary {limits.first_token}..{limits.vocab_size - 1}"
                )
        if limits.eos_id in c.tokens[:-1]:
            raise BadRollout(f"{where}: tokens continue after the end of the completion")
        for lp in c.logprobs:
            if not (math.isfinite(lp) and lp <= 0.0):
                raise BadRollout(f"{where}: log-prob {lp!r} is not a finite number <= 0")
    if bundle.claimed_rewards and len(bundle.claimed_rewards) != len(bundle.completions):
        raise BadRollout(
            f"{len(bundle.claimed_rewards)} claimed rewards for {len(bundle.completions)} completions"
            " (one per completion, or none)"
        )
    for i, claim in enumerate(bundle.claimed_rewards):
        if not (math.isfinite(claim) and 0.0 <= claim <= limits.max_reward):
            raise BadRollout(f"completion {i}: claimed reward {claim!r} is not a number in 0..{limits.max_reward}")
