"""A worker's transcripts of its last inner steps, for data nodes' step audits (shoal.train.step_audit).

Kept only where the run's data nodes audit steps (`defense.step_audit_rate` > 0): each inner step
copies θ and AdamW's moments before it, and keeps each microbatch's input and output gradient that
went into it, so a data node can replay any of the last KEPT_STEPS steps after it is over. A data node
decides which step to audit after the step, so a replica cannot behave only in audited ones.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import Ack, StepTranscriptHeader, StepTranscriptRequest
from shoal.train.inner import InnerOptimizer, OptimizerState, optimizer_state
from shoal.train.step_audit import StepTranscript

logger = logging.getLogger(__name__)

KEPT_STEPS = 3
PENDING = "pending: the step that took it is not taken yet"
WIRE_DTYPE = "float32"


class StepRecorder:
    def __init__(self, enabled: bool, compute: str = "cpu:float32"):
        self.enabled, self.compute = enabled, compute
        self.ids: list[str] = []  # microbatches whose gradient is in since the last step
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []  # a Subspace Network's run only
        self.steps: deque[StepTranscript] = deque(maxlen=KEPT_STEPS)
        self._before: tuple[tuple[torch.Tensor, ...], OptimizerState] | None = None
        self.served = 0

    def note_backward(
        self, microbatch_id: str, x: torch.Tensor, grad: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> None:
        """A microbatch's gradient went into the weights' gradients (its input, its output's gradient,
        and in a Subspace Network's run its token ids)."""
        if self.enabled:
            self.ids.append(microbatch_id)
            self.inputs.append(x.detach())
            self.grads.append(grad.detach())
            if tokens is not None:
                self.tokens.append(tokens)

    def before_step(self, module: torch.nn.Module, optimizer: InnerOptimizer) -> None:
        """On the compute thread, just before the optimizer step."""
        if self.enabled:
            self._before = tuple(p.detach().clone() for p in module.parameters()), optimizer_state(optimizer)

    def after_step(self, module: torch.nn.Module, at: int, lr_scale: float) -> None:
        """On the compute thread, once the step (`at`: the run's step it closed) is taken: θ as it stands
        now is what this replica computes with from here on."""
        if not self.enabled or self._before is None:
            return
        before, state = self._before
        after = tuple(p.detach().clone() for p in module.parameters())
        self.steps.append(
            StepTranscript(
                at,
                lr_scale,
                state,
                before,
                after,
                tuple(self.ids),
                tuple(self.inputs),
                tuple(self.grads),
                tuple(self.tokens),
            )  # fmt: skip
        )
        self._before = None
        self.ids, self.inputs, self.grads, self.tokens = [], [], [], []

    def find(self, microbatch_id: str) -> StepTranscript | str | None:
        """The kept step that took `microbatch_id`, PENDING while its step is not taken, else None."""
        for transcript in self.steps:
            if microbatch_id in transcript.microbatch_ids:
                return transcript
        return PENDING if microbatch_id in self.ids else None

    async def serve(self, request: StepTranscriptRequest, stream: FramedStream) -> None:
        found = self.find(request.microbatch_id) if self.enabled else None
        if not isinstance(found, StepTranscript):
            reason = found or ("no step audits in this run" if not self.enabled else "no kept step took it")
            await stream.write_message(Ack(accepted=False, reason=reason))
            return
        await stream.write_message(Ack(accepted=True))
        t = found
        header = StepTranscriptHeader(
            step=t.step,
            step_count=t.state.step_count,
            lr_scale=t.lr_scale,
            tensors=len(t.before),
            adam_steps=t.state.adam_steps,
            microbatch_ids=t.microbatch_ids,
            rows=tuple(x.shape[0] for x in t.inputs),
            seq_lens=tuple(x.shape[1] for x in t.inputs),
            compute=self.compute,
        )
        await stream.write_message(header)
        for tensor in (*t.before, *t.state.exp_avg, *t.state.exp_avg_sq, *t.after):
            await stream.write_tensor(tensor.float(), WIRE_DTYPE, kind="audit")
        for k, (x, grad) in enumerate(zip(t.inputs, t.output_grads, strict=True)):
            await stream.write_tensor(x.float(), WIRE_DTYPE, kind="audit")
            await stream.write_tensor(grad.float(), WIRE_DTYPE, kind="audit")
            if t.tokens:
                await stream.write_exact(t.tokens[k].to(torch.int64), "int64", kind="audit")
        self.served += 1
