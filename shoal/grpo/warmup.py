"""Supervised warm-up on task demonstrations, cached on disk under the policy's model id.

GRPO needs a policy that is sometimes right: a randomly initialised decoder never earns a reward, so
every group is all-equal and every advantage is zero. A few hundred teacher-forced steps on
`prompt -> canonical answer` pairs give it that start. The warm-up is part of the run, not a
download; its result is cached by `PolicySpec.model_id` (a hash of every field), written to a
temporary name and renamed, so a half-written file is never loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from shoal.files import atomic_save
from shoal.grpo.policy import CheckpointPolicySpec, Policy, PolicySpec
from shoal.grpo.tasks import TRAIN, get_task, task_seed

IGNORED = -100  # cross-entropy's ignore_index: prompt positions and padding

log = logging.getLogger(__name__)


Spec = PolicySpec | CheckpointPolicySpec


def demonstration_batch(spec: Spec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both (B, T); targets are IGNORED over the prompt and after the answer. The
    prompt and the answer are tokenized apart, as the policy reads a prompt and writes a completion."""
    task, tokenizer = get_task(spec.task), spec.tokenizer()
    seed = task_seed(spec.seed, "warmup")  # apart from any run's GRPO prompts
    seqs, starts = [], []
    for i in range(spec.warmup_batch):
        prompt = task.prompt(seed, step, i, TRAIN).text
        prompt_ids = tokenizer.encode_prompt(prompt)
        seqs.append(prompt_ids + tokenizer.encode(task.demonstration(prompt)))
        starts.append(len(prompt_ids))
    width = max(map(len, seqs))
    tokens = torch.full((len(seqs), width), tokenizer.pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), width - 1), IGNORED, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        targets[i, start - 1 : len(s) - 1] = torch.tensor(s[start:])  # learn the answer only, not the prompt
    return tokens[:, :-1], targets


def warm_up(spec: Spec) -> tuple[Policy, dict]:
    """Train a fresh policy on demonstrations; returns it and a small report."""
    _, policy, report = next(warm_up_stages(spec, [spec.warmup_steps]))
    return policy, report


def warm_up_stages(spec: Spec, stops: Iterable[int]) -> Iterator[tuple[Spec, Policy, dict]]:
    """One warm-up run, handed out after each of `stops` steps as (the spec warming up that many steps,
    the policy, its report). The schedule never looks ahead, so the policy after n steps is the one a
    spec with `warmup_steps = n` warms up to. The policy handed out is the one still being trained:
    save or copy it before asking for the next stage.

    Why stages: where a small policy starts to get answers right depends on the CPU's kernels (seen:
    650 steps gave 23 % held-out accuracy on one machine and 5 % on an AVX-512 one), so a caller that
    needs a policy that is sometimes right picks the first stage that is, in one run.
    """
    policy = Policy(spec)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec.warmup_lr, weight_decay=0.0)
    started, loss, done = time.perf_counter(), torch.tensor(float("nan")), 0
    for stop in sorted(set(stops)):
        for step in range(done, stop):
            lr = spec.warmup_lr * min(1.0, (step + 1) / 20)  # a short linear ramp keeps Adam's first steps sane
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = demonstration_batch(spec, step)
            logits = policy(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORED)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
        done = stop
        staged = dataclasses.replace(spec, warmup_steps=stop)
        report = {
            "model_id": staged.model_id,
            "seconds": time.perf_counter() - started,
            "final_loss": float(loss.detach()),
        }
        yield staged, policy, report


def cached_warm_up(spec: Spec, cache_dir: Path) -> tuple[Policy, dict]:
    """The warmed-up policy for `spec`, trained the first time and loaded from `cache_dir` after."""
    if spec.warmup_steps == 0:  # nothing to learn or keep: the spec's own starting weights
        return Policy(spec), {"model_id": spec.model_id, "seconds": 0.0, "final_loss": float("nan"), "cached": False}
    path = Path(cache_dir) / f"policy-{spec.model_id}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        policy = Policy(spec)
        policy.load_state_dict(saved["state"])
        return policy, {**saved["report"], "cached": True}
    policy, report = warm_up(spec)
    save_warm_up(spec, policy, report, cache_dir)
    log.info("warmed up %s in %.1f s (loss %.3f)", spec.model_id, report["seconds"], report["final_loss"])
    return policy, {**report, "cached": False}


def save_warm_up(spec: Spec, policy: Policy, report: dict, cache_dir: Path) -> Path:
    """Cache `policy` as `spec`'s warm-up, where `cached_warm_up` looks for it."""
    path = Path(cache_dir) / f"policy-{spec.model_id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    described = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "checkpoint"}
    saved = {"state": policy.state_dict(), "report": report, "spec": described}
    atomic_save(path, lambda tmp: torch.save(saved, tmp))
    return path
