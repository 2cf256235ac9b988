"""Step audits: replay one inner step of a stage replica and check that its weights moved only as its
gradients say.

Comparing a stage's replicas (shoal.train.audit, shoal.train.robust) gives nothing where an attacker
holds every replica of the stage (papers/backdoor.md's threat): a backdoor blended into the weights
passes every comparison with itself. A replica's inner step, though, is a function of what it held
before (θ, AdamW's moments, its step counter) and of what it was sent (each microbatch's input and its
output's gradient). A data node that samples a step after it is over asks one replica for that
transcript, redoes the step with the same `InnerOptimizer`, and checks:

- the inputs and output gradients it sent that replica itself (first and last hops of its routes) are
  the ones the transcript lists, and every microbatch of its own the replica took is there;
- the outputs the replica returned it (last hops) are what θ-before computes from those inputs;
- θ-after is where the replayed step lands, within float noise of a different summation order.

What it cannot see: a replica that keeps an honest copy to report while it computes with another
whose outputs differ only off the audited inputs (a backdoor's trigger), and anything done in an
outer step (between inner steps). Inputs and gradients that came from other workers are as the
replica reports them. See docs/security.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from shoal.config import OptimConfig
from shoal.model.stages import over_the_wire
from shoal.train.inner import InnerOptimizer, OptimizerState, load_optimizer_state

# θ-after may differ from the replay by this share of the step's own size (‖replayed − before‖).
# Honest replicas measured 0 to 1e-6 (the same code and CPU replays a step bit for bit or nearly);
# a backdoor blending 1/96 of its direction per step moved θ by about 0.1 of a step (tests).
STEP_TOLERANCE = 1e-3
# An output may differ from the replay by this share of its norm: a narrow wire rounds twice, once at
# the replica and once here, and one ulp before rounding can flip an int8 level.
OUTPUT_TOLERANCE = 1e-2
# Inputs and output gradients that this data node sent are compared as the replica received them.
INPUT_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class StepTranscript:
    """One inner step of a replica, as the replica reports it."""

    step: int  # the run's step the optimizer was told it closes (its schedule's clock)
    lr_scale: float
    state: OptimizerState  # before the step
    before: tuple[torch.Tensor, ...]  # θ before the step
    after: tuple[torch.Tensor, ...]  # θ after it: what the replica then computes with
    microbatch_ids: tuple[str, ...]
    inputs: tuple[torch.Tensor, ...]  # per microbatch, the input it ran forward (as received)
    output_grads: tuple[torch.Tensor, ...]  # per microbatch, its output's gradient (as received)
    tokens: tuple[torch.Tensor, ...] = ()  # per microbatch, its token ids (a Subspace Network's run only)


@dataclasses.dataclass(frozen=True)
class Known:
    """What a data node itself knows of one of its microbatches at the audited replica, each as the
    replica received it (None where another worker sent it)."""

    input: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    output: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # the token ids it sent with them (a Subspace Network's run)


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    passed: bool
    discrepancy: float  # ‖θ-after − replay‖ ÷ ‖replay − θ-before‖ (0 when not replayed)
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Replayed:
    after: list[torch.Tensor]
    outputs: list[torch.Tensor]  # per microbatch, θ-before's output, as the next peer receives it
    skipped: bool


def replay_step(
    module: nn.Module, optim: OptimConfig, total_steps: int, transcript: StepTranscript, wire_dtype: torch.dtype
) -> Replayed:
    """Redo `transcript`'s step on `module` (the stage's architecture; its weights are overwritten)."""
    with torch.no_grad():
        for p, before in zip(module.parameters(), transcript.before, strict=True):
            p.copy_(before)
    optimizer = InnerOptimizer(module, optim, total_steps, lr_scale=transcript.lr_scale)
    load_optimizer_state(optimizer, transcript.state)
    outputs = []
    tokens = transcript.tokens or (None,) * len(transcript.inputs)
    for x, grad, ids in zip(transcript.inputs, transcript.output_grads, tokens, strict=True):
        with torch.enable_grad():
            y = module(x.detach(), ids)
        y.backward(grad)
        with torch.no_grad():
            outputs.append(over_the_wire(y.detach(), wire_dtype))
    stats = optimizer.step(transcript.step)
    return Replayed([p.detach().clone() for p in module.parameters()], outputs, stats.skipped)


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def step_discrepancy(
    claimed: Sequence[torch.Tensor], replayed: Sequence[torch.Tensor], before: Sequence[torch.Tensor]
) -> float:
    off = _norm([c - r for c, r in zip(claimed, replayed, strict=True)])
    moved = _norm([r - b for r, b in zip(replayed, before, strict=True)])
    return off / moved if moved > 0 else (0.0 if off == 0 else float("inf"))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return _norm([a - b]) / max(_norm([b]), 1e-30)


def judge_step(
    transcript: StepTranscript,
    replayed: Replayed,
    known: Mapping[str, Known],
    step_tolerance: float = STEP_TOLERANCE,
    output_tolerance: float = OUTPUT_TOLERANCE,
) -> StepVerdict:
    """Whether `transcript` holds up against its replay and against what the auditing data node knows
    (`known`: its own microbatches the replica took, by id)."""
    listed = {mb: k for k, mb in enumerate(transcript.microbatch_ids)}
    for mb, ours in known.items():
        k = listed.get(mb)
        if k is None:
            return StepVerdict(False, 0.0, f"left microbatch {mb} it took out of its step")
        if ours.tokens is not None and not (transcript.tokens and torch.equal(transcript.tokens[k], ours.tokens)):
            return StepVerdict(False, 0.0, f"reported token ids of {mb} that are not the ones it was sent")
        if ours.input is not None and _relative(transcript.inputs[k], ours.input) > INPUT_TOLERANCE:
            return StepVerdict(False, 0.0, f"reported an input of {mb} that is not the one it was sent")
        if ours.output_grad is not None and _relative(transcript.output_grads[k], ours.output_grad) > INPUT_TOLERANCE:
            return StepVerdict(False, 0.0, f"reported a gradient of {mb} that is not the one it was sent")
        if ours.output is not None and _relative(replayed.outputs[k], ours.output) > output_tolerance:
            off = _relative(replayed.outputs[k], ours.output)
            return StepVerdict(False, 0.0, f"its output for {mb} is {off:.3g} of its size off what its weights compute")
    discrepancy = step_discrepancy(transcript.after, replayed.after, transcript.before)
    if not discrepancy <= step_tolerance:
        return StepVerdict(
            False, discrepancy, f"its weights moved {discrepancy:.3g} of a step away from what its gradients say"
        )
    return StepVerdict(True, discrepancy)
