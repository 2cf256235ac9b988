"""Forward on a stage worker: take a forward (or say "busy", or that it was taken already), run it on
the weights its data node's previous step left, keep its graph for the backward, and pass the output
on to the next hop, or home to the data node.

What a worker holds is bounded by the node's advertised in-flight memory: the forwards it computes
and, for training, the graphs it keeps; past that bound a sender is told "busy" and picks another
replica. A forward still computing may be given a new route meanwhile (`ResumeForward`, redo.py): a
hop after ours was lost before the activation got there, and the output leaves along the new route.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from shoal.model.split_backward import LinearCall, recording_linears
from shoal.node.compute import FORWARD
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine, push_forward
from shoal.node.pipeline.hops import HopFailed, lost_kind, planned_start
from shoal.node.pipeline.worker.admission import Admission
from shoal.node.pipeline.worker.kept import KeptState, Saved
from shoal.node.pipeline.worker.notices import note_route, notify_abandon
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.stepper import Stepper
from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import Ack, ForwardRequest, Hop


class Forwarder:
    """The forwards of a worker of `stage` through `module`, from when one is taken until its output is
    passed on: the only ones its graph is not yet kept for (`kept.saved`)."""

    def __init__(
        self,
        hops: PipelineEngine,
        stage: int,
        module: torch.nn.Module,
        admission: Admission,
        clock: StepClock,
        stepper: Stepper,
        kept: KeptState,
    ) -> None:
        self.hops, self.ctx, self.stage, self.module = hops, hops.ctx, stage, module
        self.admission, self.clock, self.stepper, self.kept = admission, clock, stepper, kept
        self.hooks = hops.ctx.hooks
        self.forwarding: set[str] = set()  # forwards accepted, not yet saved (evaluation: not yet passed on)
        # the requests of forwards still computing, and routes their data node resumed them on meanwhile:
        # a hop after ours was lost before the activation got there
        self.computing: dict[str, ForwardRequest] = {}
        self.resumed_routes: dict[str, tuple[Hop, ...]] = {}
        self.forwards = 0

    async def on_forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        refusal = self.admission.check_forward(request, sender)
        x = await self.hops.read_activation(stream)
        tokens = self.hops.read_tokens(request.tokens, x)
        if refusal is None:
            refusal = await self.admission.check_step(request, sender)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        mb = request.microbatch_id
        if mb in self.forwarding or self.kept.ran_forward(mb):
            return self.taken(request.origin)  # a retried stream (its ack was lost): we already ran it
        held = len(self.forwarding) + (len(self.kept.saved) if request.needs_backward else 0)
        if held >= self.ctx.max_inflight:  # evaluation forwards too: every kind of work has a bound
            return Ack(accepted=False, reason=f"busy: {self.ctx.max_inflight} microbatches in flight")
        self.forwarding.add(mb)
        self.computing[mb] = request
        self.hops.spawn(self._forward(request, x, tokens), f"forward {mb}")
        return self.taken(request.origin)

    def taken(self, origin: str) -> Ack:
        """A forward taken, with what GWTF's senders learn of us from it: the microbatches we hold and
        our onward cost (the router says none under other routings)."""
        onward = self.ctx.router.advert(self.ctx.peer_id, origin)
        if onward is None or not math.isfinite(onward):
            return Ack(accepted=True)
        load = len(self.forwarding) + len(self.kept.saved)
        return Ack(accepted=True, load=load, onward_s=min(max(onward, 0.0), 1e6))

    def reroute(self, microbatch_id: str, route: tuple[Hop, ...]) -> None:
        """A forward still computing leaves along `route` once computed: its data node resumed it there
        (redo.py), a hop after ours having been lost before the activation got there."""
        self.resumed_routes[microbatch_id] = route

    def run_forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None, needs_backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[LinearCall]]:
        """The forward pass, on the compute thread: with the graph and Linear calls a backward needs."""
        if not needs_backward:
            with torch.no_grad():
                return x, self.module(x, tokens), []
        x = x.requires_grad_(True)
        with torch.enable_grad(), recording_linears(self.module) as calls:
            y = self.module(x, tokens)
        self.stepper.graph_made()
        return x, y, calls

    async def _gated_forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None, needs_backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[LinearCall]]:
        """The forward pass, never across an inner step (see `Stepper.building_graph`)."""
        if not needs_backward:
            return await self.hops.compute(self.run_forward, x, tokens, False, priority=FORWARD)
        async with self.stepper.building_graph():
            return await self.hops.compute(self.run_forward, x, tokens, True, priority=FORWARD)

    async def _forward(self, request: ForwardRequest, x: torch.Tensor, tokens: torch.Tensor | None) -> None:
        self.hooks.before_forward(request.step, self.ctx.short_id)
        try:
            await self.clock.after_previous_close(request)
            await planned_start(request.starts, request.hop)
            await self._forward_and_pass_on(request, x, tokens)
        finally:  # an evaluation forward holds its slot until its output is delivered or given up
            self.forwarding.discard(request.microbatch_id)
            self.computing.pop(request.microbatch_id, None)
            self.resumed_routes.pop(request.microbatch_id, None)

    async def _forward_and_pass_on(self, request: ForwardRequest, x: torch.Tensor, tokens: torch.Tensor | None) -> None:
        mb, kept = request.microbatch_id, self.kept
        try:
            x, y, calls = await self._gated_forward(x, tokens, request.needs_backward)
            await self.hooks.after_forward()
            if request.needs_backward:
                nxt = request.route[request.hop + 1].stage if request.hop + 1 < len(request.route) else None
                where = (kept.expiry(), request.origin, request.hop, request.step, nxt)
                kept.saved[mb] = Saved(x, y, *where, calls=calls, tokens=request.tokens)
            kept.forwarded[mb] = kept.expiry()
        finally:
            if request.needs_backward:  # from here on `saved` holds its slot
                self.forwarding.discard(mb)
        self.forwards += 1
        self.computing.pop(mb, None)
        resumed = self.resumed_routes.pop(mb, None)  # without planned starts: not the path planned
        onward = ForwardRequest(
            microbatch_id=mb,
            origin=request.origin,
            step=request.step,
            hop=request.hop + 1,
            route=request.route if resumed is None else resumed,
            needs_backward=request.needs_backward,
            starts=request.starts if resumed is None else (),
            tokens=request.tokens,
        )
        named = None if onward.hop == len(onward.route) else onward.route[onward.hop].peer_id
        onward = self._choose_next_hop(onward)
        try:
            delivered = await push_forward(self.hops, onward, self.hooks.activation(y.detach()))
            home = delivered.hop == len(delivered.route)
            if mb in kept.saved:
                kept.saved[mb].next_peer = delivered.origin if home else delivered.route[delivered.hop].peer_id
            if not home and delivered.route[delivered.hop].peer_id != named:
                self.hops.spawn(note_route(self.ctx, delivered), f"route note {mb}")
        except HopFailed as e:
            kept.drop(mb)
            await notify_abandon(
                self.ctx,
                request.origin,
                mb,
                f"forward after stage {self.stage}: {e}",
                lost_kind(e, AbandonReason.FORWARD),
            )

    def _choose_next_hop(self, onward: ForwardRequest) -> ForwardRequest:
        """With SWARM routing every sender picks the next hop itself, by its own balancer."""
        router = self.ctx.router
        if not router.hop_by_hop or onward.hop >= len(onward.route):
            return onward
        stage = onward.route[onward.hop].stage
        pick = router.next_hop(self.ctx.peer_id, stage, onward.origin, exclude=self.hops.banned())
        if pick is None or pick == onward.route[onward.hop].peer_id:
            return onward
        route = list(onward.route)
        route[onward.hop] = Hop(stage=stage, peer_id=pick)
        return replace(onward, route=tuple(route))
