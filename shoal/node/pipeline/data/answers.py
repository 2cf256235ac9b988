"""What a data node answers the hops of its microbatches: an activation coming home (the loss, and the
gradient sent back), a gradient reaching the embedding, a request for the embedding again, a note of a
re-routed hop, and a hop that gives up. Each is taken only from a peer that took part in that
microbatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from shoal.logs import printable
from shoal.model.split_backward import WeightGrads
from shoal.node.compute import BACKWARD, WEIGHT_GRAD
from shoal.node.context import NodeContext
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.data.attempts import COMPLETED, Attempts, Ending, InFlight, Outcome
from shoal.node.pipeline.data.recovery import Recovery
from shoal.node.pipeline.hops import HopFailed
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import FramedStream
from shoal.planning.observed import Trip
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackwardRequest,
    ForwardRequest,
    Hop,
    OutputRequest,
    RouteNote,
    check_hop,
)

logger = logging.getLogger(__name__)

TRIPS_KEPT = 256  # the latest forward trips the observed hop times are fitted to


class MicrobatchAnswers:
    """`hops`: the engine's hop layer (base.py); `head`: its stage 0, whose LM head computes the loss;
    `note_output` hears of each training output that came home (the step audits keep it)."""

    def __init__(
        self,
        ctx: NodeContext,
        hops: PipelineEngine,
        head: torch.nn.Module,
        attempts: Attempts,
        recovery: Recovery,
        note_output: Callable[[str, torch.Tensor], None],
    ):
        self.ctx, self.hops, self.head = ctx, hops, head
        self.attempts, self.recovery = attempts, recovery
        self.note_output = note_output
        self.in_flight = attempts.in_flight
        self.refused = 0  # requests a peer was not entitled to send
        self.recent_trips: deque[Trip] = deque(maxlen=TRIPS_KEPT)  # forward trips, for routing by observed speed
        self.weight_grads: list[asyncio.Future] = []  # the LM head's deferred W passes of this step

    async def weight_grads_done(self) -> None:
        """The LM head's weight gradients of this step are all accumulated (before its optimizer step)."""
        pending, self.weight_grads = self.weight_grads, []
        await asyncio.gather(*pending)

    async def _route_refusal(self, entry: InFlight, sender: str, route: tuple[Hop, ...], first: bool) -> str | None:
        """Why `route`, as `sender` hands this microbatch back (its last hop home; `first`: its first hop
        with the gradient), is not the route we sent it along, if it is not. It has our route's length
        and our stage at every hop; where it names another peer than we know at a hop, that peer is a
        live replica of the hop's stage (it took the hop over: the sender's own pick, a resume, a hop
        redone). We keep its peers (whom the step close reaches, whom a step audit holds to the
        microbatch), never its stages."""
        if not route or sender != route[0 if first else -1].peer_id:
            return "not the first hop" if first else "not the last hop"
        stages = tuple(hop.stage for hop in route)
        if stages != entry.route_stages:
            return f"the route's stages {stages[:8]} are not those of this microbatch {entry.route_stages[:8]}"
        for hop, ours in zip(route, entry.route_peers, strict=True):
            if hop.peer_id != ours and not await self.hops.listed(hop.peer_id, (hop.stage,)):
                return f"the route names a peer at stage {hop.stage} that holds no replica of it"
        return None

    def _refuse(self, sender: str, microbatch_id: str, why: str) -> str:
        self.refused += 1
        logger.warning("[%s] refused %s from %s: %s", self.ctx.short_id, microbatch_id[:96], sender[-8:], why)
        return why

    # ---- an activation coming home ----------------------------------------------------------------

    async def on_forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        check_hop(request)
        x = await self.hops.read_activation(stream)
        entry = self.in_flight.get(request.microbatch_id)
        if request.hop != len(request.route) or request.origin != self.ctx.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None:
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        why = await self._route_refusal(entry, sender, request.route, first=False)
        if why is not None:
            return Ack(accepted=False, reason=self._refuse(sender, request.microbatch_id, why))
        if entry.home:
            return Ack(accepted=True)  # a retried stream: we already have it
        if tuple(x.shape[:2]) != tuple(entry.targets.shape):
            return Ack(accepted=False, reason=f"activation shape {tuple(x.shape)} does not match the microbatch")
        if entry.capture:  # an audit's or a probe's forward: the activation itself is the answer
            entry.home, entry.output = True, x
            self.attempts.end(request.microbatch_id, COMPLETED)
            return Ack(accepted=True)
        entry.home = True
        self.attempts.note_route(entry, request.route)  # as delivered, after any re-routing
        self.recent_trips.append(Trip(entry.route_peers, time.monotonic() - entry.injected_at))
        self.hops.spawn(self._loss_and_backward(request, entry, x), f"loss {request.microbatch_id}")
        return Ack(accepted=True)

    def _loss_and_grad(
        self, entry: InFlight, x: torch.Tensor, train: bool
    ) -> tuple[float, torch.Tensor | None, WeightGrads | None]:
        if not train:
            with torch.no_grad():
                return float(self.head.loss(x, entry.targets, entry.tokens)), None, None
        return self.head.loss_and_input_grad(x, entry.targets, entry.loss_scale, entry.tokens)

    async def _loss_and_backward(self, request: ForwardRequest, entry: InFlight, x: torch.Tensor) -> None:
        """The loss, and for a training microbatch (ours to say: `entry.train`, never the request's
        `needs_backward`) the gradient sent back along the route."""
        if entry.train:
            self.note_output(request.microbatch_id, x)
        entry.loss, grad, weight_grad = await self.hops.compute(
            self._loss_and_grad, entry, x, entry.train, priority=BACKWARD
        )
        if grad is None:
            self.attempts.end(request.microbatch_id, COMPLETED)
            return
        assert weight_grad is not None
        # the last block stage waits for `grad`, nobody for the LM head's weight gradient: it runs when
        # this node has nothing more urgent, at the latest before the optimizer step
        self.weight_grads.append(self.hops.compute_thread.run(WEIGHT_GRAD, weight_grad.accumulate))
        last = len(request.route) - 1
        starts = entry.backward_starts if len(entry.backward_starts) == len(request.route) else ()
        entry.backward = BackwardRequest(
            microbatch_id=request.microbatch_id,
            origin=request.origin,
            step=request.step,
            hop=last,
            route=request.route,
            starts=starts,
        )
        entry.grad = grad
        target = request.route[last].peer_id
        try:
            await self.hops.send(target, EngineRpcs.backward, entry.backward, grad)
        except HopFailed as e:
            self.hops.ban(target, e)
            entry.recovered.add(target)
            await self.recovery.redo_hop(request.microbatch_id, entry, target, str(e))

    # ---- a gradient reaching the embedding, and the embedding asked for again ---------------------

    async def on_backward(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        check_hop(request)
        entry = self.in_flight.get(request.microbatch_id)
        hops = self.hops
        spec = replace(hops.activation_spec, shape=tuple(entry.embedded.shape)) if entry else hops.activation_spec
        grad = await stream.read_tensor(spec, max_bytes=hops.max_activation_bytes, device=hops.device)
        if request.hop != -1 or request.origin != self.ctx.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None or not entry.home:
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        why = await self._route_refusal(entry, sender, request.route, first=True)
        if why is not None:
            return Ack(accepted=False, reason=self._refuse(sender, request.microbatch_id, why))
        if entry.done.done() or entry.embedding_grad:
            return Ack(accepted=True)  # a retried stream
        entry.embedding_grad = True
        self.ctx.router.returned(self.ctx.peer_id, request.route[0].peer_id)
        self.attempts.note_route(entry, request.route)  # with any hop redone by a replacement
        hops.spawn(self._embedding_backward(request.microbatch_id, entry, grad), f"embed-bwd {request.microbatch_id}")
        return Ack(accepted=True)

    async def _embedding_backward(self, microbatch_id: str, entry: InFlight, grad: torch.Tensor) -> None:
        await self.hops.compute(entry.embedded.backward, grad, priority=BACKWARD)
        self.attempts.end(microbatch_id, COMPLETED)

    async def on_fetch_output(self, request: OutputRequest, stream: FramedStream, sender: str) -> None:
        """A replica redoing the first hop asks for its input again: the embedding we sent."""
        entry = self.in_flight.get(request.microbatch_id)
        if entry is None or request.hop != -1 or not await self.hops.listed(sender):
            await self.hops.serve_output(None, "no output kept for that microbatch and hop", stream)
            return
        await self.hops.serve_output(entry.embedded.detach(), "", stream)

    # ---- a re-routed hop, and a hop that gives up -------------------------------------------------

    async def on_route_note(self, note: RouteNote, sender: str) -> Ack:
        """A hop of this microbatch's forward sent it on to another peer than the route named (it picks
        the next hop itself, or re-routed): note the peer, so a resume starts from the right hop. Taken
        only from a hop of it or a replica of the stage before, naming a replica of the stage noted. In
        backward, the hop after a lost one had a stand-in redo it: noted the same way (from that hop
        after), so that a stand-in lost too has the hop redone again."""
        entry = self.in_flight.get(note.microbatch_id)
        if entry is not None and not entry.done.done() and entry.home and entry.backward is not None:
            return await self._note_stand_in(entry, note, sender)
        if entry is None or entry.done.done() or entry.home or not 0 < note.hop < len(entry.route_peers):
            return Ack(accepted=False, reason="unknown microbatch, or not in forward")
        if entry.route_stages[note.hop] != note.stage:
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "a note for another stage"))
        before = (entry.route_stages[note.hop - 1],)
        if sender != entry.route_peers[note.hop - 1] and not await self.hops.listed(sender, before):
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "not the hop before"))
        if not await self.hops.listed(note.peer_id, (note.stage,)):
            return Ack(accepted=False, reason="the peer noted holds no replica of that stage")
        if entry.route_peers[note.hop] != note.peer_id:
            entry.route_peers = tuple(note.peer_id if i == note.hop else p for i, p in enumerate(entry.route_peers))
        return Ack(accepted=True)

    async def _note_stand_in(self, entry: InFlight, note: RouteNote, sender: str) -> Ack:
        assert entry.backward is not None
        route = entry.backward.route
        if not 0 <= note.hop < len(route) - 1 or route[note.hop].stage != note.stage:
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "a note for another hop"))
        if sender != route[note.hop + 1].peer_id:
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "not the hop after"))
        if not await self.hops.listed(note.peer_id, (note.stage,)):
            return Ack(accepted=False, reason="the peer noted holds no replica of that stage")
        stand_in = Hop(stage=note.stage, peer_id=note.peer_id)
        noted = tuple(stand_in if i == note.hop else hop for i, hop in enumerate(route))
        entry.backward = replace(entry.backward, route=noted)
        entry.route_peers = tuple(h.peer_id for h in entry.backward.route)
        entry.redone.add(note.hop)
        return Ack(accepted=True)

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        """A hop of this microbatch (on its route, or a replica of one of its stages that redid a hop)
        says it cannot go on. Its reason is a peer's text: made printable before we log or keep it."""
        entry = self.in_flight.get(notice.microbatch_id)
        if entry is None or entry.done.done():
            return Ack(accepted=False, reason="unknown microbatch")
        if sender not in entry.route_peers and not await self.hops.listed(sender, entry.route_stages):
            return Ack(accepted=False, reason=self._refuse(sender, notice.microbatch_id, "not a hop of it"))
        reason = AbandonReason.parse(notice.kind)
        outcome = Outcome.ABANDONED if entry.home or reason is AbandonReason.STAGE_LOST else Outcome.RESEND
        self.attempts.end(notice.microbatch_id, Ending(outcome, reason, printable(notice.reason, 200)))
        return Ack(accepted=True)
