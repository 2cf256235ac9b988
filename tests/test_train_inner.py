"""The inner optimizer keeps the run's learning-rate schedule, whatever steps a replica served."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.config import OptimConfig
from shoal.train.inner import InnerOptimizer
from shoal.train.schedule import learning_rate


def stepped(module: nn.Module, optimizer: InnerOptimizer, at: int | None = None):
    module.weight.grad = torch.ones_like(module.weight)
    return optimizer.step(at)


def test_a_replica_that_served_no_microbatch_in_some_steps_steps_at_the_runs_clock():
    """A stage replica steps only after steps it took part in; its schedule must not lag its stage's
    (a lagging replica took steps of up to 3 x what the others' could, and its partners refused it)."""
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    module = nn.Linear(4, 4, bias=False)
    optimizer = InnerOptimizer(module, optim, total_steps=20)
    assert stepped(module, optimizer, at=0).lr == pytest.approx(learning_rate(0, optim, 20))
    late = stepped(module, optimizer, at=9)  # steps 1-8 went to other replicas
    assert late.step == 9 and late.lr == pytest.approx(learning_rate(9, optim, 20))
    assert optimizer.step_count == 10
    assert stepped(module, optimizer, at=4).step == 10  # the clock never goes back (a late close)
    assert stepped(module, optimizer).step == 11  # no clock given: one step on, as a single process does


def test_a_step_with_a_non_finite_gradient_is_skipped_but_counts_on_the_clock():
    module = nn.Linear(4, 4, bias=False)
    before = module.weight.detach().clone()
    optimizer = InnerOptimizer(module, OptimConfig(), total_steps=10)
    module.weight.grad = torch.full_like(module.weight, float("nan"))
    stats = optimizer.step(at=3)
    assert stats.skipped and optimizer.skipped == 1 and optimizer.step_count == 4
    assert torch.equal(module.weight.detach(), before) and module.weight.grad is None
