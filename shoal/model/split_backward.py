"""Zero-bubble pipelining's B/W split (Qi et al., 2023) for the stages of this decoder.

A stage's backward does two things: B, the gradient in the stage's input, which the hop before it
waits for; and W, the gradients of the stage's weights, which only its optimizer step needs.
Passing B's result on first and running W while the pipeline drains takes W off every step's
critical path. For an `nn.Linear`, W is one matrix product of the layer's input and the gradient
in its output, both known once B has run; the rest (norm weights, biases) is cheap and comes with B.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LinearCall:
    layer: nn.Linear
    input: torch.Tensor  # detached: W needs its values, not its graph
    output: torch.Tensor  # in the forward graph: B asks for the gradient in it


@contextmanager
def recording_linears(module: nn.Module) -> Iterator[list[LinearCall]]:
    """Every `nn.Linear` call inside `module` while the `with` block runs, in call order."""
    calls: list[LinearCall] = []

    def record(layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        calls.append(LinearCall(layer, inputs[0].detach(), output))  # type: ignore[arg-type]

    handles = [m.register_forward_hook(record) for m in module.modules() if isinstance(m, nn.Linear)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def add_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """What autograd's accumulation does: the first gradient is taken, later ones are added."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


@dataclass
class WeightGrads:
    """The W pass of one microbatch: (weight, gradient in the layer's output, layer's input)."""

    pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]

    def accumulate(self) -> None:
        """As Linear's backward: under autocast the product runs in the output's (half) precision, as
        autograd's would, and lands in the weight's dtype."""
        for weight, output_grad, layer_input in self.pending:
            grad = output_grad.flatten(0, -2).t().mm(layer_input.flatten(0, -2).to(output_grad.dtype))
            add_grad(weight, grad.to(weight.dtype))
        self.pending = []


def input_grad_first(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor | None, calls: Sequence[LinearCall]
) -> tuple[torch.Tensor, WeightGrads]:
    """B now: the gradient in `x` of `y` (weighted by `grad`; None for a scalar `y`), with every
    parameter gradient of `module` added except the recorded Linears' weights, whose W pass is
    returned for later. `calls` are the Linear calls recorded while `y` was computed from `x`."""
    deferred = {id(call.layer.weight) for call in calls}
    others = [p for p in module.parameters() if p.requires_grad and id(p) not in deferred]
    wanted = [x, *others, *(call.output for call in calls)]
    grads = torch.autograd.grad(y, wanted, grad, allow_unused=True)
    x_grad = grads[0]
    assert x_grad is not None, "the output does not depend on the input"
    for param, param_grad in zip(others, grads[1 : 1 + len(others)], strict=True):
        if param_grad is not None:  # a parameter off this path (the embedding, on the way out)
            add_grad(param, param_grad)
    output_grads = grads[1 + len(others) :]
    pending = [(c.layer.weight, g, c.input) for c, g in zip(calls, output_grads, strict=True) if g is not None]
    return x_grad, WeightGrads(pending)
