"""The inner optimizer of one stage: AdamW, per-stage gradient clipping, the run's schedule.

Gradients are clipped per stage, not over the whole model: a stage worker only sees its own
gradients, and the single-process reference trainer clips the same way so the two match step for
step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shoal.config import OptimConfig
from shoal.train.schedule import learning_rate


@dataclass(frozen=True)
class StepStats:
    step: int
    lr: float
    grad_norm: float  # before clipping; inf or nan when the step was skipped
    skipped: bool = False


class InnerOptimizer:
    def __init__(self, module: nn.Module, optim: OptimConfig, total_steps: int, lr_scale: float = 1.0):
        self.module, self.optim, self.total_steps, self.lr_scale = module, optim, total_steps, lr_scale
        decay = [p for p in module.parameters() if p.dim() >= 2]
        no_decay = [p for p in module.parameters() if p.dim() < 2]  # norms: no weight decay
        groups = [{"params": decay, "weight_decay": optim.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        self.adamw = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=True)
        self.step_count = 0
        self.skipped = 0

    def step(self, at: int | None = None) -> StepStats:
        """Clip, step and zero the gradients accumulated since the last step; `at` is the run's step
        this one closes (the schedule's clock: a stage replica that served no microbatch in some steps
        took no optimizer step in them, and must not lag behind its stage's schedule for it).

        A step whose gradient norm is not finite is skipped (and counted): its gradients are dropped
        and the weights stay as they were. Clipped finite gradients move each weight by at most about
        the learning rate, so the weights of a step taken stay finite too. The step still counts on
        the run's clock, so the learning-rate schedule stays aligned with the other stages."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.optim.grad_clip)) if params else 0.0
        if at is not None:
            self.step_count = max(self.step_count, at)
        lr = learning_rate(self.step_count, self.optim, self.total_steps) * self.lr_scale
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.skipped += 1
        else:
            for group in self.adamw.param_groups:
                group["lr"] = lr
            self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        stats = StepStats(step=self.step_count, lr=lr, grad_norm=grad_norm, skipped=skipped)
        self.step_count += 1
        return stats


@dataclass(frozen=True)
class OptimizerState:
    """AdamW's state of one stage, in `parameters()` order (empty moments: no step taken yet)."""

    step_count: int  # InnerOptimizer.step_count
    adam_steps: tuple[float, ...]
    exp_avg: tuple[torch.Tensor, ...]
    exp_avg_sq: tuple[torch.Tensor, ...]


def optimizer_state(optimizer: InnerOptimizer) -> OptimizerState:
    """A copy of `optimizer`'s state: to report later (step audits), or to hand to a joining replica."""
    steps, avg, avg_sq = [], [], []
    for p in optimizer.module.parameters():
        state = optimizer.adamw.state.get(p, {})
        steps.append(float(state["step"]) if "step" in state else 0.0)
        avg.append(state["exp_avg"].detach().clone() if "exp_avg" in state else torch.zeros_like(p))
        avg_sq.append(state["exp_avg_sq"].detach().clone() if "exp_avg_sq" in state else torch.zeros_like(p))
    return OptimizerState(optimizer.step_count, tuple(steps), tuple(avg), tuple(avg_sq))


def load_optimizer_state(optimizer: InnerOptimizer, state: OptimizerState) -> None:
    """Go on from `state` (its moments on each parameter's device and dtype)."""
    optimizer.step_count = state.step_count
    for p, step, avg, avg_sq in zip(
        optimizer.module.parameters(), state.adam_steps, state.exp_avg, state.exp_avg_sq, strict=True
    ):
        if step > 0:
            optimizer.adamw.state[p] = {
                # fused AdamW reads `step` on the parameter's device (torch moves it there only when
                # state goes through load_state_dict); on a GPU a host tensor fails its device check
                "step": torch.tensor(step, dtype=torch.float32, device=p.device),
                "exp_avg": avg.to(p).clone(),
                "exp_avg_sq": avg_sq.to(p).clone(),
            }
