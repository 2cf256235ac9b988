"""A replica's transcripts of its last inner steps, kept for step audits (step_audit.py).

Each inner step keeps θ and AdamW's moments before it, θ after it, and each microbatch's input and
output gradient that went into it, for the last `AUDIT_KEPT_STEPS` steps: a data node picks the step
to audit after it is over and asks at once (its step close's answers are its cue), so the step it
names is the last or, where the next close overtook the request, the one before.

θ after one step is θ before the next unless something moved it in between (an outer step, a copy
adopted): one tensor then serves as both, so the steps kept cost (`AUDIT_KEPT_STEPS` + 1) copies of θ
at most, two of the moments each, and the next step's moments while it is taken
(planning/memory.py counts the same).
"""

from __future__ import annotations

from collections import deque

import torch

from shoal.planning.memory import AUDIT_KEPT_STEPS
from shoal.train.inner import InnerOptimizer, optimizer_state
from shoal.train.step_audit import StepTranscript

PENDING = "pending: the step that took it is not taken yet"


class StepRecorder:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.ids: list[str] = []  # microbatches whose gradient is in since the last step
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []  # a Subspace Network's run only
        self.steps: deque[StepTranscript] = deque(maxlen=AUDIT_KEPT_STEPS)
        self._before: tuple[tuple[torch.Tensor, ...], object] | None = None

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
        if not self.enabled:
            return
        params = [p.detach() for p in module.parameters()]
        last = self.steps[-1].after if self.steps else None
        unmoved = last is not None and all(torch.equal(a, p) for a, p in zip(last, params, strict=True))
        before = last if unmoved else tuple(p.clone() for p in params)
        self._before = before, optimizer_state(optimizer)

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
