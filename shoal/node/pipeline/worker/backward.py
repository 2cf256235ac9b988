"""Backward on a stage worker, split in two (ZeroBubble's B/W split): the B pass computes the gradient
in our input and passes it upstream at once; the W pass accumulates our parameters' gradients when
the compute thread has a free moment, at the latest before the next inner step.

A gradient is taken once per microbatch (a retried stream is answered as done) and only from the
peer admission.py allows. The gradient passed upstream is kept until the microbatch is over: if the
hop before ours dies holding its graph, another replica of its stage redoes that hop from it
(`RecomputeRequest`); only a stage with no replica left loses the microbatch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

import torch

from shoal.model.split_backward import WeightGrads, input_grad_first
from shoal.node.compute import BACKWARD, WEIGHT_GRAD
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.hops import HopFailed, lost_kind, planned_start
from shoal.node.pipeline.worker.admission import Admission
from shoal.node.pipeline.worker.kept import KeptState, Saved, SentGradient
from shoal.node.pipeline.worker.notices import note_route, notify_abandon
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.stepper import Stepper
from shoal.node.pipeline.worker.transcripts import TranscriptServer
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import Ack, BackwardRequest

logger = logging.getLogger(__name__)


class Backwarder:
    """The backwards of a worker through `module`: each adds its data node's step to the `clock`'s
    contributors, its W pass to the `stepper`'s, and its input to the step audit's `transcripts`."""

    def __init__(
        self,
        hops: PipelineEngine,
        module: torch.nn.Module,
        admission: Admission,
        kept: KeptState,
        clock: StepClock,
        stepper: Stepper,
        transcripts: TranscriptServer,
    ) -> None:
        self.hops, self.ctx, self.module = hops, hops.ctx, module
        self.admission, self.kept = admission, kept
        self.clock, self.stepper, self.transcripts = clock, stepper, transcripts
        self.hooks = hops.ctx.hooks
        self.backwards = 0

    async def on_backward(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        hops, kept = self.hops, self.kept
        refusal = self.admission.check_hop(request, sender)
        saved = kept.saved.get(request.microbatch_id)
        spec = hops.activation_spec if saved is None else replace(hops.activation_spec, shape=tuple(saved.y.shape))
        grad = await stream.read_tensor(spec, max_bytes=hops.max_activation_bytes, device=hops.device)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        if request.microbatch_id in kept.backward_done:
            return Ack(accepted=True)  # a retried stream: already done
        saved = kept.saved.get(request.microbatch_id)  # (it may have expired while we read)
        if saved is None:
            return Ack(accepted=False, reason="unknown or expired microbatch")
        refusal = await self.admission.check_gradient_sender(request, saved, sender)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        del kept.saved[request.microbatch_id]  # its graph lives on until `_run_backward` releases it
        kept.backward_done[request.microbatch_id] = kept.expiry()
        if saved.next_stage is not None and saved.next_peer is not None:
            self.ctx.router.returned(self.ctx.peer_id, saved.next_peer)
        hops.spawn(self.backward(request, saved, grad), f"backward {request.microbatch_id}")
        return Ack(accepted=True)

    def _run_backward(self, saved: Saved, grad: torch.Tensor) -> tuple[torch.Tensor, WeightGrads]:
        grad_in, weight_grads = input_grad_first(self.module, saved.x, saved.y, grad, saved.calls)
        saved.calls = []
        self.stepper.graph_released()
        return grad_in, weight_grads

    async def backward(self, request: BackwardRequest, saved: Saved, grad: torch.Tensor) -> None:
        """The B pass, then the gradient upstream at once. A hop after the first has a stage upstream
        waiting for that gradient, and its W pass waits for a free moment of the compute thread (at the
        latest, the next inner step). The first hop passes its gradient to the data node, which only
        adds it to the embedding: its W pass comes next, or W passes would pile up at the end of the
        step and hold back the next step's first forward, which waits for our inner step."""
        await planned_start(request.starts, request.hop)
        grad_in, weight_grads = await self.hops.compute(self._run_backward, saved, grad, priority=BACKWARD)
        tokens = self.hops.read_tokens(saved.tokens, saved.x) if saved.tokens and self.transcripts.enabled else None
        self.transcripts.note_backward(request.microbatch_id, saved.x, grad, tokens)
        self.stepper.queue_weight_grads(BACKWARD if request.hop == 0 else WEIGHT_GRAD, weight_grads.accumulate)
        self.backwards += 1
        self.clock.contributed(request.origin, request.step)
        if request.hop > 0:
            upstream_peer = request.route[request.hop - 1].peer_id
            await self.hooks.before_upstream(request.step, request.hop, request.microbatch_id, upstream_peer,
                                             self.ctx.short_id)  # fmt: skip
        upstream = BackwardRequest(
            microbatch_id=request.microbatch_id,
            origin=request.origin,
            step=request.step,
            hop=request.hop - 1,
            route=request.route,
            starts=request.starts,
        )
        await self._send_upstream(upstream, self.hooks.gradient(grad_in), saved.tokens)
        await self.stepper.maybe_step()

    async def _send_upstream(self, upstream: BackwardRequest, grad_in: torch.Tensor, tokens: bytes) -> None:
        """Pass a gradient to the hop before ours; if that hop is gone with its graph, have another
        replica of its stage redo it. Only when its stage has no replica left is the microbatch lost."""
        mb = upstream.microbatch_id
        target = upstream.origin if upstream.hop < 0 else upstream.route[upstream.hop].peer_id
        try:
            await self.hops.send(target, EngineRpcs.backward, upstream, grad_in)
        except HopFailed as e:
            if upstream.hop < 0:
                logger.warning("[%s] %s: its data node did not take the gradient: %s", self.ctx.short_id, mb, e)
                return
            self.hops.ban(target, e)
            try:
                route = await self.hops.delegate_recompute(upstream, upstream.hop, grad_in, target, str(e), tokens)
            except HopFailed as lost:
                await notify_abandon(
                    self.ctx,
                    upstream.origin,
                    mb,
                    f"backward into hop {upstream.hop}: {lost}",
                    lost_kind(lost, AbandonReason.BACKWARD),
                )
                return
            # the stand-in takes the lost hop's place, here (a RecoverRequest names it) and at the data node
            upstream = dataclasses.replace(upstream, route=route)
            self.hops.spawn(note_route(self.ctx, upstream), f"route note {mb}")
        if upstream.hop >= 0:
            self.kept.sent[mb] = SentGradient(upstream, grad_in, self.kept.expiry(), tokens)
