"""A worker's transcripts of its last inner steps, served to data nodes' step audits (shoal.train.step_audit).

Kept only where the run's data nodes audit steps (`defense.step_audit_rate` > 0), by the recorder in
shoal/train/transcripts.py, so that a data node can replay any of the last few steps after it is over.
A data node decides which step to audit after the step, so a replica cannot behave only in audited ones.
"""

from __future__ import annotations

import logging

import torch

from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import Ack, StepTranscriptHeader, StepTranscriptRequest
from shoal.train.step_audit import StepTranscript
from shoal.train.transcripts import StepRecorder

logger = logging.getLogger(__name__)

WIRE_DTYPE = "float32"


class TranscriptServer(StepRecorder):
    """The recorder (shoal/train/transcripts.py) and the stream that hands a data node a kept step."""

    def __init__(self, enabled: bool, compute: str = "cpu:float32"):
        super().__init__(enabled)
        self.compute = compute
        self.served = 0

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
