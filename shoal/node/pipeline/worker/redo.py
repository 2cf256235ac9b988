"""Redoing a lost hop on a stage worker, so that a peer that dies costs its hops, not its microbatches.

- Recompute (`RecomputeRequest`): the holder of a hop died with its graph; the hop after it, holding
  the gradient, has a replica of the same stage (us) redo just that hop: the forward from the input
  the hop before kept (`OutputRequest`, which we answer too), then the backward.
  Where the hop before is gone too, its output is redone by a replica of its stage
  (`RedoOutputRequest`), which walks upstream the same way, to the data node's own input at the end.
- Recover (`RecoverRequest`): the data node saw the peer we passed a gradient to leave; the gradient
  we kept has its hop redone by another replica.
- Resume (`ResumeForward`): the data node lost the hop after ours; the output we keep, or the one we
  are still computing, goes on to the replica its new route names.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from shoal.logs import printable
from shoal.node.compute import BACKWARD
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine, push_forward
from shoal.node.pipeline.hops import HopFailed, lost_kind
from shoal.node.pipeline.worker.admission import Admission, route_problem
from shoal.node.pipeline.worker.backward import Backwarder
from shoal.node.pipeline.worker.forward import Forwarder
from shoal.node.pipeline.worker.kept import KeptState, Saved, SentGradient
from shoal.node.pipeline.worker.notices import note_route, notify_abandon
from shoal.node.pipeline.worker.stepper import Stepper
from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import (
    Ack,
    BackwardRequest,
    ForwardRequest,
    OutputRequest,
    RecomputeRequest,
    RecoverRequest,
    RedoOutputRequest,
    ResumeForward,
)


class Redo:
    """The redos a worker of `stage` does: its own forward and backward (`forwarder`, `backwarder`) run
    again on what `kept` holds."""

    def __init__(
        self,
        hops: PipelineEngine,
        stage: int,
        admission: Admission,
        kept: KeptState,
        stepper: Stepper,
        forwarder: Forwarder,
        backwarder: Backwarder,
    ) -> None:
        self.hops, self.ctx, self.stage = hops, hops.ctx, stage
        self.admission, self.kept, self.stepper = admission, kept, stepper
        self.forwarder, self.backwarder = forwarder, backwarder
        self.hooks = hops.ctx.hooks
        self.recomputed = 0
        self.recompute_s = 0.0
        self.resumed = 0  # forwards passed on again for the data node, after the hop after ours was lost
        self.outputs_redone = 0  # outputs of a lost hop of our stage computed again for the hop after it

    # ---- recompute --------------------------------------------------------------------------------

    async def on_recompute(self, request: RecomputeRequest, stream: FramedStream, sender: str) -> Ack:
        """Redo a hop whose holder is gone: our own forward from its kept input, then backward. Asked
        only by the hop after it, which holds the gradient."""
        hops, kept = self.hops, self.kept
        refusal = self.admission.check_recompute(request, sender)
        grad = await stream.read_tensor(hops.activation_spec, max_bytes=hops.max_activation_bytes, device=hops.device)
        hops.check_activation(grad)
        tokens = hops.read_tokens(request.tokens, grad)
        if refusal is None:
            refusal = await self.admission.check_step(request, sender)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        mb = request.microbatch_id
        if mb in kept.backward_done:
            return Ack(accepted=True)
        stale = kept.saved.get(mb)  # we may hold its forward ourselves (an expired or refused graph)
        if stale is not None and (refusal := await self.admission.check_gradient_sender(request, stale, sender)):
            return Ack(accepted=False, reason=refusal)  # a route the sender wrote cannot take our graph
        kept.backward_done[mb] = kept.expiry()
        if kept.saved.pop(mb, None) is not None:
            self.stepper.graph_released()  # the recompute builds its own
        hops.spawn(self._recompute(request, grad, tokens), f"recompute {mb}")
        return Ack(accepted=True)

    async def _recompute(self, request: RecomputeRequest, grad: torch.Tensor, tokens: torch.Tensor | None) -> None:
        started = time.monotonic()
        mb = request.microbatch_id
        try:
            x = await self._input(request)
        except HopFailed as e:
            await notify_abandon(
                self.ctx,
                request.origin,
                mb,
                f"recompute of hop {request.hop}: input lost: {e}",
                lost_kind(e, AbandonReason.RECOMPUTE),
            )
            return
        if tuple(x.shape) != tuple(grad.shape):
            await notify_abandon(
                self.ctx,
                request.origin,
                mb,
                f"recompute of hop {request.hop}: shapes disagree",
                AbandonReason.RECOMPUTE,
            )
            return
        x, y, calls = await self.hops.compute(self.forwarder.run_forward, x, tokens, True, priority=BACKWARD)
        nxt = request.route[request.hop + 1].stage if request.hop + 1 < len(request.route) else None
        saved = Saved(x, y, self.kept.expiry(), request.origin, request.hop, request.step, nxt, calls=calls,
                      tokens=request.tokens)  # fmt: skip
        as_backward = BackwardRequest(
            microbatch_id=mb, origin=request.origin, step=request.step, hop=request.hop, route=request.route
        )
        self.recomputed += 1
        await self.backwarder.backward(as_backward, saved, grad)
        self.recompute_s += time.monotonic() - started

    async def _input(self, request: RecomputeRequest | RedoOutputRequest) -> torch.Tensor:
        """The input of hop `request.hop`: what the hop before kept, or, where that hop's holder is gone
        with it, that hop's output redone by a live replica of its stage, which gets its own input the
        same way: the walk upstream ends at the data node's embedding output at the latest, so two
        (or more) consecutive hops lost cost their recomputes, not the microbatch."""
        hop, mb = request.hop, request.microbatch_id
        if hop == 0:
            return await self.hops.fetch_output(request.origin, mb, -1)  # the data node gone: nothing to redo from
        holder = request.route[hop - 1].peer_id
        try:
            return await self.hops.fetch_output(holder, mb, hop - 1)
        except HopFailed as lost:
            return await self.hops.redo_output(request, hop - 1, holder, f"input lost: {lost}")

    async def on_redo_output(self, request: RedoOutputRequest, stream: FramedStream, sender: str) -> None:
        """The replica redoing the hop after ours lost its input with our stage's holder: compute what
        that holder sent on, from its own input (walking further upstream if that is gone too), and send
        it. Nothing is kept: the hop's backward, when it comes, is a recompute of its own."""
        if request.hop + 1 >= len(request.route):
            await self.hops.serve_output(None, "the hop after ours is the data node: it asks no redo", stream)
            return
        refusal = self.admission.check_recompute(request, sender) or await self.admission.check_step(request, sender)
        if refusal is None and not await self.hops.listed(sender, (request.route[request.hop + 1].stage,)):
            refusal = self.admission.refuse(sender, request.microbatch_id, "a redo is asked only by a listed worker")
        if refusal is not None:
            await self.hops.serve_output(None, refusal, stream)
            return
        try:
            x = await self._input(request)
        except HopFailed as e:
            await self.hops.serve_output(None, f"its input is lost too: {printable(str(e), 120)}", stream)
            return
        tokens = self.hops.read_tokens(request.tokens, x)
        _, y, _ = await self.hops.compute(self.forwarder.run_forward, x, tokens, False, priority=BACKWARD)
        self.outputs_redone += 1
        await self.hops.serve_output(y, "", stream)

    async def on_fetch_output(self, request: OutputRequest, stream: FramedStream, sender: str) -> None:
        """A replica redoing the hop after ours asks for its input again: what we sent it."""
        saved = self.kept.saved.get(request.microbatch_id)
        if saved is None or saved.hop != request.hop or not await self.hops.listed(sender):
            await self.hops.serve_output(None, "no output kept for that microbatch and hop", stream)
            return
        await self.hops.serve_output(saved.y.detach(), "", stream)

    # ---- recover ----------------------------------------------------------------------------------

    async def on_recover(self, request: RecoverRequest, sender: str) -> Ack:
        """The data node saw the peer we passed a gradient to leave: have its hop redone elsewhere."""
        kept = self.kept.sent.get(request.microbatch_id)
        if kept is None or sender != kept.request.origin:
            return Ack(accepted=False, reason="no gradient kept for that microbatch from that data node")
        if kept.request.route[kept.request.hop].peer_id != request.lost_peer:
            return Ack(accepted=False, reason="that peer did not take this microbatch from us")
        del self.kept.sent[request.microbatch_id]
        self.hops.ban(request.lost_peer)
        self.hops.spawn(self._recover(kept, request.lost_peer), f"recover {request.microbatch_id}")
        return Ack(accepted=True)

    async def _recover(self, kept: SentGradient, lost_peer: str) -> None:
        try:
            route = await self.hops.delegate_recompute(
                kept.request, kept.request.hop, kept.grad, lost_peer, "it left the swarm", kept.tokens
            )
            # the stand-in takes the lost hop's place, here and at the data node: it may be lost too
            request = dataclasses.replace(kept.request, route=route)
            self.kept.sent[request.microbatch_id] = dataclasses.replace(kept, request=request)
            await note_route(self.ctx, request)
        except HopFailed as e:
            await notify_abandon(
                self.ctx,
                kept.request.origin,
                kept.request.microbatch_id,
                f"recover: {e}",
                lost_kind(e, AbandonReason.RECOVER),
            )

    # ---- resume -----------------------------------------------------------------------------------

    async def on_resume_forward(self, request: ResumeForward, sender: str) -> Ack:
        """The data node lost the hop after ours: pass the output we keep on to the hop `route` names
        instead. Only for the microbatch as we forwarded it, from its own data node, and only to the
        stage we passed it to."""
        saved = self.kept.saved.get(request.microbatch_id)
        computing = self.forwarder.computing.get(request.microbatch_id)
        if saved is None and computing is not None:
            return self._resume_when_computed(request, computing, sender)
        if saved is None or sender != saved.origin:
            return Ack(accepted=False, reason="no output kept for that microbatch from that data node")
        route, hop = request.route, request.hop
        if not 0 <= hop < len(route) or hop != saved.hop or route[hop].peer_id != self.ctx.peer_id:
            return Ack(accepted=False, reason="that route does not name us where we forwarded it")
        if (problem := route_problem(saved.origin, route, self.ctx.run.pipeline.stages)) is not None:
            return Ack(accepted=False, reason=self.admission.refuse(sender, request.microbatch_id, problem))
        if (route[hop + 1].stage if hop + 1 < len(route) else None) != saved.next_stage:
            return Ack(accepted=False, reason="that route sends it to another stage than we did")
        onward = ForwardRequest(
            microbatch_id=request.microbatch_id, origin=saved.origin, step=saved.step, hop=hop + 1, route=route,
            tokens=saved.tokens,
        )  # fmt: skip
        self.resumed += 1
        self.hops.spawn(self._resume(onward, saved), f"resume {request.microbatch_id}")
        return Ack(accepted=True)

    def _resume_when_computed(self, request: ResumeForward, computing: ForwardRequest, sender: str) -> Ack:
        """The lost hop is one the activation has not reached yet and ours still computes it: pass it
        on along the new route once computed. Checked as a resume of kept output is."""
        route, hop = request.route, request.hop
        if sender != computing.origin or hop != computing.hop or not 0 <= hop < len(route):
            return Ack(accepted=False, reason="that route does not name us where we are forwarding it")
        if route[hop].peer_id != self.ctx.peer_id or len(route) != len(computing.route):
            return Ack(accepted=False, reason="that route does not name us where we are forwarding it")
        if any(a.stage != b.stage for a, b in zip(route, computing.route, strict=True)):
            return Ack(accepted=False, reason="that route sends it through other stages than we were sent")
        if (problem := route_problem(computing.origin, route, self.ctx.run.pipeline.stages)) is not None:
            return Ack(accepted=False, reason=self.admission.refuse(sender, request.microbatch_id, problem))
        self.forwarder.reroute(request.microbatch_id, route)
        self.resumed += 1
        return Ack(accepted=True)

    async def _resume(self, onward: ForwardRequest, saved: Saved) -> None:
        try:
            delivered = await push_forward(self.hops, onward, self.hooks.activation(saved.y.detach()))
            home = delivered.hop == len(delivered.route)
            saved.next_peer = delivered.origin if home else delivered.route[delivered.hop].peer_id
            if not home and delivered.route != onward.route:  # re-routed around a failed replica
                self.hops.spawn(note_route(self.ctx, delivered), f"route note {onward.microbatch_id}")
        except HopFailed as e:
            await notify_abandon(
                self.ctx,
                onward.origin,
                onward.microbatch_id,
                f"resume after stage {self.stage}: {e}",
                lost_kind(e, AbandonReason.FORWARD),
            )
