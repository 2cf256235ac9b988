"""One node's GRPO round, as two calls around the exchange: `make_bundle`, then `learn`.

    prompts = round_prompts(cfg, r)                        # every node derives the same prompts
    own = make_bundle(policy, cfg, prompts, generator)     # sample this node's share of each group
    ... send `own` to peers, receive theirs ...
    report = learn(policy, optimizer, cfg, prompts, own, received)

`learn` validates every foreign bundle against this round (refused ones are skipped and reported,
never half-used), scores every completion itself, and takes one optimizer step on the GRPO loss of
`cfg.grpo.mode`. The daemon (phase 2) and benchmarks/grpo.py call exactly these functions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.grpo.defenses import DefenseConfig, LengthMemory, group_length_penalised, judged_rewards, make_judge, screen
from shoal.grpo.loss import GRPOConfig, LossStats, grpo_loss
from shoal.grpo.policy import Policy, completion_logprobs
from shoal.grpo.rollout import build_batch, to_bundle
from shoal.grpo.sampling import sample
from shoal.grpo.tasks import CORRECT_REWARD, Prompt, get_task
from shoal.grpo.tokenizer import PolicyTokenizer
from shoal.protocol.rollout import BadRollout, RolloutBundle, RolloutLimits, validate_bundle


@dataclass(frozen=True)
class RoundConfig:
    task: str = "add2r"
    run_seed: int = 0
    prompts_per_round: int = 16  # B
    completions_per_prompt: int = 4  # this node's share of each group (G/m in the horizontal layout)
    max_foreign_per_prompt: int = 16  # the most a peer's bundle may add to one group
    lr: float = 1e-3
    grad_clip: float = 1.0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    run_id: str | None = None  # stamped on own bundles and required of foreign ones, when set
    sample_top_k: int = 0  # k_g: own completions come from the top k tokens (0: the whole vocabulary)
    defense: DefenseConfig = field(default_factory=DefenseConfig)


@dataclass(frozen=True)
class RoundReport:
    round: int
    loss: LossStats
    own_reward: float  # mean recomputed reward of own completions
    own_correct: float  # share of own completions that are fully correct
    foreign_reward: float  # nan without foreign completions
    foreign_correct: float
    refused: tuple[str, ...]  # "model id: reason" per refused bundle
    checks: tuple[tuple[int, int, str], ...] = ()  # per foreign bundle: (completions, rejected, first reason)
    foreign_rejected: int = 0  # completions the defenses kept out of the groups
    length_cut: int = 0  # completions, own or foreign, whose reward the length rule took
    defense_s: float = 0.0  # seconds spent in the checks of received bundles (and the judge, the length rule)
    score_s: float = 0.0  # seconds spent scoring every completion (decoding it, the task's reward)
    update_s: float = 0.0  # seconds of the update: log-probs, the loss, its backward and the step


def round_prompts(cfg: RoundConfig, round: int) -> list[Prompt]:
    task = get_task(cfg.task)
    return [task.prompt(cfg.run_seed, round, i) for i in range(cfg.prompts_per_round)]


def rollout_limits(cfg: RoundConfig, tokenizer: PolicyTokenizer, round: int) -> RolloutLimits:
    """What a peer's bundle for `round` may hold, from this node's run config and tokenizer."""
    return RolloutLimits(
        task=cfg.task,
        round=round,
        tokenizer_id=tokenizer.tokenizer_id,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        prompts=cfg.prompts_per_round,
        max_new_tokens=get_task(cfg.task).max_new_tokens,
        max_per_prompt=cfg.max_foreign_per_prompt,
        run_id=cfg.run_id,
        max_reward=CORRECT_REWARD,
        first_token=tokenizer.first_id,
    )


def make_bundle(
    policy: Policy, cfg: RoundConfig, prompts: list[Prompt], generator: torch.Generator | None = None
) -> RolloutBundle:
    """This node's completions of this round's prompts, with their log-probs (temperature 1) and the
    rewards it computed for them (claims no defended peer reads, sent so that a naive one has them)."""
    tokenizer, task = policy.spec.tokenizer(), get_task(cfg.task)
    samples = sample(
        policy,
        [tokenizer.encode_prompt(p.text) for p in prompts],
        cfg.completions_per_prompt,
        task.max_new_tokens,
        tokenizer.eos_id,
        generator,
        top_k=cfg.sample_top_k,
    )
    bundle = to_bundle(samples, prompts, policy.model_id, tokenizer.tokenizer_id)
    by_index = {p.index: p.text for p in prompts}
    claims = tuple(task.reward(by_index[c.prompt_index], tokenizer.decode(c.tokens)) for c in bundle.completions)
    bundle = dataclasses.replace(bundle, claimed_rewards=claims)
    return bundle if cfg.run_id is None else dataclasses.replace(bundle, run_id=cfg.run_id)


def check_bundles(
    bundles: Sequence[RolloutBundle], limits: RolloutLimits
) -> tuple[list[RolloutBundle], tuple[str, ...]]:
    """(the bundles that pass `validate_bundle`, one reason per refused bundle)."""
    accepted, refused = [], []
    for bundle in bundles:
        try:
            validate_bundle(bundle, limits)
        except BadRollout as error:
            refused.append(f"{bundle.model_id}: {error.message}")
        else:
            accepted.append(bundle)
    return accepted, tuple(refused)


def learn(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    cfg: RoundConfig,
    prompts: list[Prompt],
    own: RolloutBundle,
    foreign: Sequence[RolloutBundle] = (),
    reference: Policy | None = None,
    foreign_prompts: Sequence[list[Prompt]] | None = None,
    memory: LengthMemory | None = None,
) -> RoundReport:
    """Validate and check foreign bundles, recompute every reward, take one GRPO step; report it all.

    `foreign_prompts[j]` are the prompts foreign bundle j answers, when they are not `prompts` (the
    vertical layout: each node draws its own); each such bundle then forms groups of its own.
    A bundle's `claimed_rewards` are read only with `cfg.defense.enabled` False, the naive receiver of
    the reward-lie experiment, which believes a sender's claims where it sent any; a defended node
    scores everything itself and never looks at them. `memory`, the node's `LengthMemory` kept across
    rounds, gives the length rule its remembered reference and learns from this round's own answers.
    """
    task, tokenizer = get_task(cfg.task), policy.spec.tokenizer()
    limits = rollout_limits(cfg, tokenizer, own.round)
    theirs = [prompts] * len(foreign) if foreign_prompts is None else list(foreign_prompts)
    if len(theirs) != len(foreign):
        raise ValueError(f"{len(theirs)} prompt lists for {len(foreign)} foreign bundles")
    everything, valid, refused = _groups(prompts, foreign, theirs, limits, renumber=foreign_prompts is not None)
    if cfg.grpo.mode == "alone":
        valid = []  # nothing foreign is even scored
    bundles = [b for _, b in valid]
    checks = [(len(b.completions), len(b.completions), "refused") for b in foreign]
    defense_s, length_cut = 0.0, 0
    judge = make_judge(cfg.defense.judge, task, policy, tokenizer) if cfg.defense.enabled else None
    if cfg.defense.enabled and bundles:
        screening = screen(policy, task, tokenizer, everything, bundles, cfg.defense, judge)
        bundles, defense_s = screening.kept, screening.seconds
        for (j, b), rejected, reason in zip(valid, screening.rejected, screening.reasons, strict=True):
            checks[j] = (len(b.completions), rejected, reason)
    else:
        for j, b in valid:
            checks[j] = (len(b.completions), 0, "")
    began = time.perf_counter()
    batch = build_batch(task, tokenizer, everything, own, bundles)
    score_s = time.perf_counter() - began
    if not cfg.defense.enabled and any(b.claimed_rewards for b in bundles):
        scored = batch.rewards[batch.foreign].tolist()
        believed, at = [], 0
        for b in bundles:  # validated: claims are none or one per completion, each in 0..CORRECT_REWARD
            believed += list(b.claimed_rewards or scored[at : at + len(b.completions)])
            at += len(b.completions)
        batch.rewards[batch.foreign] = torch.tensor(believed, dtype=batch.rewards.dtype)
    if judge is not None:
        began = time.perf_counter()
        by_index = {p.index: p.text for p in everything}
        own_rows = len(own.completions)
        own_texts = [(by_index[c.prompt_index], tokenizer.decode(c.tokens)) for c in own.completions]
        batch.rewards[:own_rows] = judged_rewards(batch.rewards[:own_rows], own_texts, judge)
        defense_s += time.perf_counter() - began
    if cfg.defense.enabled and cfg.defense.length_rule:
        began = time.perf_counter()
        lengths = torch.tensor([len(c) for c in batch.completions])
        prompt_lengths = [len(p) for p in batch.prompts]
        remembered = memory.reference(prompt_lengths) if memory is not None else None
        earned = batch.rewards > 0
        batch.rewards = group_length_penalised(
            batch.rewards, lengths, batch.groups, cfg.defense.length_excess, remembered, own=~batch.foreign
        )
        length_cut = int((earned & (batch.rewards == 0)).sum())
        if memory is not None:
            kept = ((batch.rewards >= CORRECT_REWARD) & ~batch.foreign).nonzero().flatten().tolist()
            memory.record([prompt_lengths[i] for i in kept], [int(lengths[i]) for i in kept])
        defense_s += time.perf_counter() - began
    began = time.perf_counter()
    logp, mask = completion_logprobs(policy, batch.prompts, batch.completions)
    ref_logp = None
    if reference is not None and cfg.grpo.kl_coef > 0:
        with torch.no_grad():
            ref_logp, _ = completion_logprobs(reference, batch.prompts, batch.completions)
    loss, stats = grpo_loss(
        logp, batch.gen_logp, mask, batch.rewards, batch.groups, batch.foreign, cfg.grpo, ref_logp=ref_logp
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
    optimizer.step()
    update_s = time.perf_counter() - began
    own_r, foreign_r = batch.rewards[~batch.foreign], batch.rewards[batch.foreign]
    return RoundReport(
        round=own.round,
        loss=stats,
        own_reward=float(own_r.mean()),
        own_correct=float((own_r == CORRECT_REWARD).float().mean()),
        foreign_reward=float(foreign_r.mean()) if len(foreign_r) else float("nan"),
        foreign_correct=float((foreign_r == CORRECT_REWARD).float().mean()) if len(foreign_r) else float("nan"),
        refused=refused,
        checks=tuple(checks),
        foreign_rejected=sum(rejected for _, rejected, reason in checks if reason != "refused"),
        length_cut=length_cut,
        defense_s=defense_s,
        score_s=score_s,
        update_s=update_s,
    )


def _groups(
    prompts: list[Prompt],
    foreign: Sequence[RolloutBundle],
    theirs: Sequence[list[Prompt]],
    limits: RolloutLimits,
    renumber: bool,
) -> tuple[list[Prompt], list[tuple[int, RolloutBundle]], tuple[str, ...]]:
    """Validate each foreign bundle; returns (all prompts, (input position, bundle) per valid bundle, refusals).

    With `renumber` (the vertical layout), each valid bundle's prompts get indices past every earlier
    group, so that groups of different prompts never mix.
    """
    everything, valid, refused = list(prompts), [], []
    for j, (bundle, mine) in enumerate(zip(foreign, theirs, strict=True)):
        ok, why = check_bundles([bundle], limits)
        refused += why
        if not ok:
            continue
        if renumber:
            offset = len(everything)
            everything += [dataclasses.replace(p, index=offset + p.index) for p in mine]
            completions = tuple(
                dataclasses.replace(c, prompt_index=offset + c.prompt_index) for c in bundle.completions
            )
            bundle = dataclasses.replace(bundle, completions=completions)
        valid.append((j, bundle))
    return everything, valid, tuple(refused)


def make_optimizer(policy: Policy, cfg: RoundConfig) -> torch.optim.Optimizer:
    """Adam without weight decay, as in both papers (their lr 5e-6 is for 1.5B models; ours is tiny),
    over the parameters that train (`CheckpointPolicySpec.train_last`)."""
    return torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
