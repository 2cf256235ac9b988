"""A stage worker: forward and backward for its block stage, its inner optimizer, and the redo of a
lost hop.

Forward keeps the input and output of every microbatch until its gradient comes back, bounded by
the node's advertised in-flight memory; past it, a sender is told "busy" and picks another
replica. Backward accumulates parameter gradients and keeps the gradient it sent upstream until
the microbatch is over, so that if the upstream hop dies holding its graph, another replica of that
stage can redo just that hop (`RecomputeRequest`). The inner optimizer steps when the data nodes
this worker served say their step is closed (`StepClose`), never by counting microbatches.
Everything a request names is keyed by microbatch id, and a repeated request is taken as done:
a sender that retries a broken stream never makes a hop run twice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

import torch

from shoal.device import compute_kind
from shoal.model.hf import initial_stage
from shoal.model.split_backward import LinearCall, WeightGrads, input_grad_first, recording_linears
from shoal.node.averaging.base import Averager
from shoal.node.averaging.modes import AVERAGERS
from shoal.node.compute import BACKWARD, FORWARD, WEIGHT_GRAD
from shoal.node.context import NodeContext
from shoal.node.engine import (
    AbandonReason,
    GradNorms,
    Handler,
    Progress,
    Repair,
    TrainedState,
    outer_state_of,
    restore_trained,
)
from shoal.p2p.transport import FramedStream, call
from shoal.node.pipeline.hops import (
    WIRE_MAX_ABS,
    HopFailed,
    PipelineEngine,
    lost_kind,
    planned_start,
    push_forward,
    step_close_patience_s,
)
from shoal.node.pipeline.worker.transcripts import StepRecorder
from shoal.node.stage.copy import join_stage, serve_stage_copy
from shoal.node.stage.edge_copy import EdgeCopyKeeper, keeps_edge_copy
from shoal.node.stage.repair import repair_stage, stage_was_lost
from shoal.planning.swarm_view import ROLE_DATA
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackwardRequest,
    ForwardRequest,
    Hop,
    OutputRequest,
    RecomputeRequest,
    RecoverRequest,
    ResumeForward,
    RouteNote,
    StageCopyRequest,
    StepClose,
    StepTranscriptRequest,
    check_hop,
)
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)

# A data node sends a step's forwards without waiting for its close of the step before to be answered,
# and a forward may overtake that close: it waits this long for the close to arrive (see
# `_after_previous_close`). A close that does not come by then was lost, and the forward goes ahead.
CLOSE_OVERTAKEN_WAIT_S = 5.0


@dataclass
class Saved:
    x: torch.Tensor  # the input, requiring grad
    y: torch.Tensor  # the output, with its graph
    expires_at: float
    origin: str  # the data node that owns the microbatch (the only peer that may release it)
    hop: int  # this node's position in the microbatch's route
    step: int  # the data node's step it belongs to: once that step is closed, no gradient can come
    next_stage: int | None  # the stage we passed the output to (None: the data node)
    next_peer: str | None = None  # the peer that took it (set once it acknowledged)
    calls: list[LinearCall] = field(default_factory=list)  # the forward's Linear calls, for the B/W split
    tokens: bytes = b""  # the microbatch's token ids as they came (a Subspace Network's run)


@dataclass
class SentGradient:
    """A gradient this node passed upstream, kept until the microbatch is over (see RecoverRequest): its
    data node closes its step, gives it up, or it expires."""

    request: BackwardRequest  # what was sent, its route as sent
    grad: torch.Tensor
    expires_at: float
    tokens: bytes = b""  # the microbatch's token ids, for whoever redoes the hop before ours


class StageWorker(PipelineEngine):
    def __init__(self, ctx: NodeContext, stage: int):
        super().__init__(ctx)
        run = self.run
        self.stage = stage
        module = initial_stage(run.model, run.pipeline.stages, stage, run.train.seed, ctx.checkpoint)
        self.module = module.to(ctx.device)
        self.optimizer = InnerOptimizer(self.module, run.optim, run.train.steps)
        self.saved: dict[str, Saved] = {}
        self.sent: dict[str, SentGradient] = {}
        self.backward_done: dict[str, float] = {}  # microbatch id -> when to forget it
        self.forwarding: set[str] = set()  # forwards accepted, not yet saved (evaluation: not yet passed on)
        # the requests of forwards still computing, and routes their data node resumed them on meanwhile:
        # a hop after ours was lost before the activation got there
        self.computing: dict[str, ForwardRequest] = {}
        self.resumed_routes: dict[str, tuple[Hop, ...]] = {}
        self.forwarded: dict[str, float] = {}  # microbatch id -> when to forget that we ran its forward
        self.served: dict[str, float] = {}  # data node -> when to forget that we took its training forwards
        self.live_graphs = 0  # forward graphs (made on the compute thread) whose backward has not run
        self.graphs_starting = 0  # forwards past the step gate whose graph is not yet in live_graphs
        self.step_gate = asyncio.Event()  # cleared while an inner step is taken: no new graph meanwhile
        self.step_gate.set()
        # data node -> the latest of its steps whose gradient has accumulated here since our last step
        self.contributors: dict[str, int] = {}
        self.forwards = 0
        self.backwards = 0
        self.refused = 0  # requests a peer was not entitled to send
        self.recomputed = 0
        self.resumed = 0  # forwards passed on again for the data node, after the hop after ours was lost
        self.recompute_s = 0.0
        self.expired = 0
        self.copies_served = 0
        self.hooks = ctx.hooks  # fault injection and an EXPERIMENT's hostile behaviour (hooks.py)
        self.grad_norms = GradNorms()
        self.repair: Repair | None = None  # how this node rebuilt its stage, if it did (CheckFree)
        self.failed_donors: frozenset[str] = frozenset()  # listed replicas that did not give their weights
        self.closed_step = -1  # the latest data-node step closed here (the backdoor's injection clock)
        self.weight_grads: list[asyncio.Future] = []  # W passes queued since the last inner step
        self.closes_heard: dict[str, int] = {}  # per data node: the latest step whose close arrived
        self.closes_handled: dict[str, int] = {}  # ... and was handled: stepped, and averaged when due
        self._close_news = asyncio.Condition()
        averager_type = AVERAGERS.get(run.averaging.mode)  # None: replicas never share weights
        self.averager: Averager | None = averager_type(ctx, self) if averager_type is not None else None
        self.edge_copy: EdgeCopyKeeper | None = None  # CheckFree+: our copy of stage 0, if we neighbour it
        if keeps_edge_copy(run.repair.rule, run.pipeline.stages, stage):
            self.edge_copy = EdgeCopyKeeper(self, run.repair.edge_copy_every)
        # for data nodes' step audits
        self.transcripts = StepRecorder(run.defense.step_audit_rate > 0, compute_kind(ctx.device, ctx.compute_dtype))

    @property
    def busy(self) -> bool:
        return bool(self.saved) or bool(self.forwarding)

    @property
    def movable(self) -> bool:
        """Untrained and idle: this node may still change stage without losing anything."""
        return not self.busy and self.forwards == 0

    @property
    def reserved(self) -> int:
        return len(self.forwarding)

    def _check_mine(self, request: ForwardRequest | BackwardRequest | RecomputeRequest) -> str | None:
        check_hop(request)
        if request.hop < 0 or request.hop >= len(request.route):
            return "this node is not the data node of that microbatch"
        hop = request.route[request.hop]
        if hop.peer_id != self.ctx.peer_id or hop.stage != self.stage:
            return f"this node holds stage {self.stage}, not stage {hop.stage}"
        return None

    def _expiry(self) -> float:
        """How long to keep what a microbatch may still need: its own timeout, plus the time a hop
        after ours may spend waiting for a replica of a stage that has none (a redo then needs it)."""
        return time.monotonic() + self.ctx.config.limits.microbatch_timeout_s + self.ctx.config.limits.stage_wait_s

    # ---- forward ----------------------------------------------------------------------------------

    async def on_forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        refusal = self._check_mine(request)
        previous = request.origin if request.hop == 0 else request.route[request.hop - 1].peer_id
        if refusal is None and sender != previous:
            refusal = self._refuse(sender, request.microbatch_id, "a forward comes only from the hop before ours")
        x = await self.read_activation(stream)
        tokens = self.read_tokens(request.tokens, x)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        mb = request.microbatch_id
        if mb in self.forwarding or mb in self.forwarded or mb in self.saved or mb in self.backward_done:
            return self._taken(request.origin)  # a retried stream (its ack was lost): we already ran it
        held = len(self.forwarding) + (len(self.saved) if request.needs_backward else 0)
        if held >= self.ctx.max_inflight:  # evaluation forwards too: every kind of work has a bound
            return Ack(accepted=False, reason=f"busy: {self.ctx.max_inflight} microbatches in flight")
        self.forwarding.add(mb)
        self.computing[mb] = request
        if request.needs_backward:
            self.served[request.origin] = self._expiry()
        self.spawn(self._forward(request, x, tokens), f"forward {mb}")
        return self._taken(request.origin)

    def _taken(self, origin: str) -> Ack:
        """A forward taken, with what GWTF's senders learn of us from it: the microbatches we hold and
        our onward cost (the router says none under other routings)."""
        onward = self.ctx.router.advert(self.ctx.peer_id, origin)
        if onward is None or not math.isfinite(onward):
            return Ack(accepted=True)
        return Ack(accepted=True, load=len(self.forwarding) + len(self.saved), onward_s=min(max(onward, 0.0), 1e6))

    async def _after_previous_close(self, request: ForwardRequest) -> None:
        """A training forward of step s must run on the weights that its data node's step s-1 left
        here. That step's close is sent before the forward but on another stream, and the data node
        does not wait for our answer, so the forward may come first: hold it until the close has
        arrived and been handled. Only a data node we served before is owed a step; a close that does
        not arrive within CLOSE_OVERTAKEN_WAIT_S was lost, and the forward runs on the weights we have.
        Handling an arrived close is waited for as long as its data node waits for our answer: past that,
        it has given up on us (an outer step stuck in an all-reduce, say), and so do we."""
        origin, previous = request.origin, request.step - 1
        if not request.needs_backward or previous < 0 or self.closes_handled.get(origin, -1) >= previous:
            return
        if origin not in self.closes_heard and origin not in self.contributors:
            return
        async with self._close_news:
            try:
                await asyncio.wait_for(
                    self._close_news.wait_for(lambda: self.closes_heard.get(origin, -1) >= previous),
                    CLOSE_OVERTAKEN_WAIT_S,
                )
            except TimeoutError:
                logger.info("[%s] %s: no close of step %d came from its data node; forwarding on the weights we "
                            "have", self.ctx.short_id, request.microbatch_id, previous)  # fmt: skip
                return
            if not await self._handled_in_time(origin, previous):
                logger.warning("[%s] %s: the close of step %d is still being handled after %.0f s; forwarding "
                               "on the weights we have", self.ctx.short_id, request.microbatch_id, previous,
                               step_close_patience_s(self.ctx.run.averaging.exchange_timeout_s))  # fmt: skip

    async def _handled_in_time(self, origin: str, step: int) -> bool:
        """Whether `origin`'s close of `step` is handled within its patience (`_close_news` held)."""
        patience_s = step_close_patience_s(self.ctx.run.averaging.exchange_timeout_s)
        try:
            await asyncio.wait_for(
                self._close_news.wait_for(lambda: self.closes_handled.get(origin, -1) >= step), patience_s
            )
        except TimeoutError:
            return False
        return True

    def _run_forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None, needs_backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[LinearCall]]:
        if not needs_backward:
            with torch.no_grad():
                return x, self.module(x, tokens), []
        x = x.requires_grad_(True)
        with torch.enable_grad(), recording_linears(self.module) as calls:
            y = self.module(x, tokens)
        self.live_graphs += 1
        return x, y, calls

    async def _gated_forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None, needs_backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[LinearCall]]:
        """The forward pass, never across an inner step: AdamW updates the weights in place, so a graph
        built before a step and run backward after it fails. A step waits for the graphs it would
        corrupt, those already counted and those on their way to the compute thread; a forward that
        comes while a step is taken (another data node's, whose clock is not ours) waits for it."""
        if not needs_backward:
            return await self.compute(self._run_forward, x, tokens, False, priority=FORWARD)
        # A woken wait has not run yet when the step that set the gate hands over to an outer step, which
        # clears it again at once (the close that ended an inner step may end an outer epoch too): look
        # again before building a graph, or the outer step overwrites the weights under it.
        while not self.step_gate.is_set():
            await self.step_gate.wait()
        self.graphs_starting += 1
        try:
            return await self.compute(self._run_forward, x, tokens, True, priority=FORWARD)
        finally:
            self.graphs_starting -= 1
            if self.graphs_starting == 0 and self.live_graphs == 0:  # a failed forward left no graph
                self.spawn(self._maybe_step(), "deferred step")

    async def _forward(self, request: ForwardRequest, x: torch.Tensor, tokens: torch.Tensor | None) -> None:
        self.hooks.before_forward(request.step, self.ctx.short_id)
        try:
            await self._after_previous_close(request)
            await planned_start(request.starts, request.hop)
            await self._forward_and_pass_on(request, x, tokens)
        finally:  # an evaluation forward holds its slot until its output is delivered or given up
            self.forwarding.discard(request.microbatch_id)
            self.computing.pop(request.microbatch_id, None)
            self.resumed_routes.pop(request.microbatch_id, None)

    async def _forward_and_pass_on(self, request: ForwardRequest, x: torch.Tensor, tokens: torch.Tensor | None) -> None:
        mb = request.microbatch_id
        try:
            x, y, calls = await self._gated_forward(x, tokens, request.needs_backward)
            await self.hooks.after_forward()
            if request.needs_backward:
                nxt = request.route[request.hop + 1].stage if request.hop + 1 < len(request.route) else None
                where = (self._expiry(), request.origin, request.hop, request.step, nxt)
                self.saved[mb] = Saved(x, y, *where, calls=calls, tokens=request.tokens)
            self.forwarded[mb] = self._expiry()
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
            delivered = await push_forward(self, onward, self._outgoing(y.detach()))
            home = delivered.hop == len(delivered.route)
            if mb in self.saved:
                self.saved[mb].next_peer = delivered.origin if home else delivered.route[delivered.hop].peer_id
            if not home and delivered.route[delivered.hop].peer_id != named:
                self.spawn(self._note_route(delivered), f"route note {mb}")
        except HopFailed as e:
            self._drop(mb)
            await self.notify_abandon(
                request.origin, mb, f"forward after stage {self.stage}: {e}", lost_kind(e, AbandonReason.FORWARD)
            )

    def _choose_next_hop(self, onward: ForwardRequest) -> ForwardRequest:
        """With SWARM routing every sender picks the next hop itself, by its own balancer."""
        router = self.ctx.router
        if not router.hop_by_hop or onward.hop >= len(onward.route):
            return onward
        stage = onward.route[onward.hop].stage
        pick = router.next_hop(self.ctx.peer_id, stage, onward.origin, exclude=self.banned())
        if pick is None or pick == onward.route[onward.hop].peer_id:
            return onward
        route = list(onward.route)
        route[onward.hop] = Hop(stage=stage, peer_id=pick)
        return replace(onward, route=tuple(route))

    async def _note_route(self, delivered: ForwardRequest) -> None:
        """Tell the data node who took the next hop, which its route did not name (RouteNote)."""
        hop = delivered.route[delivered.hop]
        note = RouteNote(microbatch_id=delivered.microbatch_id, hop=delivered.hop, stage=hop.stage, peer_id=hop.peer_id)
        try:
            await call(self.ctx.p2p, delivered.origin, "rpc_route_note", note, Ack, timeout_s=5.0)
        except Exception as e:
            logger.info("[%s] route note for %s: %s", self.ctx.short_id, delivered.microbatch_id, e)

    async def on_fetch_output(self, request: OutputRequest, stream: FramedStream, sender: str) -> None:
        """A replica redoing the hop after ours asks for its input again: what we sent it."""
        saved = self.saved.get(request.microbatch_id)
        if saved is None or saved.hop != request.hop or not await self.listed(sender):
            await self.serve_output(None, "no output kept for that microbatch and hop", stream)
            return
        await self.serve_output(saved.y.detach(), "", stream)

    # ---- backward ---------------------------------------------------------------------------------

    async def on_backward(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        refusal = self._check_mine(request)
        saved = self.saved.get(request.microbatch_id)
        spec = self.activation_spec if saved is None else replace(self.activation_spec, shape=tuple(saved.y.shape))
        grad = await stream.read_tensor(spec, max_bytes=self.max_activation_bytes, device=self.device)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        if request.microbatch_id in self.backward_done:
            return Ack(accepted=True)  # a retried stream: already done
        saved = self.saved.get(request.microbatch_id)  # (it may have expired while we read)
        if saved is None:
            return Ack(accepted=False, reason="unknown or expired microbatch")
        refusal = await self._check_gradient_sender(request, saved, sender)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        del self.saved[request.microbatch_id]
        self.backward_done[request.microbatch_id] = self._expiry()
        if saved.next_stage is not None and saved.next_peer is not None:
            self.ctx.router.returned(self.ctx.peer_id, saved.next_peer)
        self.spawn(self._backward(request, saved, grad), f"backward {request.microbatch_id}")
        return Ack(accepted=True)

    async def _check_gradient_sender(
        self, request: BackwardRequest | RecomputeRequest, saved: Saved, sender: str
    ) -> str | None:
        """A gradient is taken only for the microbatch as we forwarded it, and only from the peer we
        passed its output to, or from a live replica of that stage that redid the hop (a recompute)."""
        mb = request.microbatch_id
        if (request.origin, request.hop, request.step) != (saved.origin, saved.hop, saved.step):
            return self._refuse(sender, mb, "a gradient names another data node, hop or step than its forward")
        home = request.hop + 1 == len(request.route)
        named = request.origin if home else request.route[request.hop + 1].peer_id
        if sender != named:
            return self._refuse(sender, mb, "a gradient comes only from the hop after ours")
        if sender == saved.next_peer or (home and saved.next_stage is None):
            return None
        if saved.next_stage is not None and await self.listed(sender, (saved.next_stage,)):
            return None  # the hop after ours was redone by another replica of its stage
        return self._refuse(sender, mb, "a gradient from a peer that did not take our output")

    def _refuse(self, sender: str, microbatch_id: str, why: str) -> str:
        """Say (bounded: one line per refusal, peer strings escaped by the log formatter) that a peer
        sent what it may not, and return the reason for its Ack."""
        self.refused += 1
        logger.warning("[%s] refused %s from %s: %s", self.ctx.short_id, microbatch_id[:96], sender[-8:], why)
        return why

    def _run_backward(self, saved: Saved, grad: torch.Tensor) -> tuple[torch.Tensor, WeightGrads]:
        grad_in, weight_grads = input_grad_first(self.module, saved.x, saved.y, grad, saved.calls)
        saved.calls = []
        self.live_graphs -= 1
        return grad_in, weight_grads

    async def _backward(self, request: BackwardRequest, saved: Saved, grad: torch.Tensor) -> None:
        """The B pass, then the gradient upstream at once. A hop after the first has a stage upstream
        waiting for that gradient, and its W pass waits for a free moment of the compute thread (at the
        latest, the next inner step). The first hop passes its gradient to the data node, which only
        adds it to the embedding: its W pass comes next, or W passes would pile up at the end of the
        step and hold back the next step's first forward, which waits for our inner step."""
        await planned_start(request.starts, request.hop)
        grad_in, weight_grads = await self.compute(self._run_backward, saved, grad, priority=BACKWARD)
        tokens = self.read_tokens(saved.tokens, saved.x) if saved.tokens and self.transcripts.enabled else None
        self.transcripts.note_backward(request.microbatch_id, saved.x, grad, tokens)
        w_priority = BACKWARD if request.hop == 0 else WEIGHT_GRAD
        self.weight_grads.append(self.compute_thread.run(w_priority, weight_grads.accumulate))
        self.backwards += 1
        self.contributors[request.origin] = max(self.contributors.get(request.origin, -1), request.step)
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
        await self._maybe_step()

    async def _send_upstream(self, upstream: BackwardRequest, grad_in: torch.Tensor, tokens: bytes) -> None:
        """Pass a gradient to the hop before ours; if that hop is gone with its graph, have another
        replica of its stage redo it. Only when its stage has no replica left is the microbatch lost."""
        mb = upstream.microbatch_id
        target = upstream.origin if upstream.hop < 0 else upstream.route[upstream.hop].peer_id
        try:
            await self.send(target, "rpc_backward", upstream, grad_in)
        except HopFailed as e:
            if upstream.hop < 0:
                logger.warning("[%s] %s: its data node did not take the gradient: %s", self.ctx.short_id, mb, e)
                return
            self.ban(target, e)
            try:
                await self.delegate_recompute(upstream, upstream.hop, grad_in, target, str(e), tokens)
            except HopFailed as lost:
                await self.notify_abandon(
                    upstream.origin,
                    mb,
                    f"backward into hop {upstream.hop}: {lost}",
                    lost_kind(lost, AbandonReason.BACKWARD),
                )
                return
        if upstream.hop >= 0:
            self.sent[mb] = SentGradient(upstream, grad_in, self._expiry(), tokens)

    async def on_recompute(self, request: RecomputeRequest, stream: FramedStream, sender: str) -> Ack:
        """Redo a hop whose holder is gone: our own forward from its kept input, then backward. Asked
        only by the hop after it, which holds the gradient."""
        refusal = self._check_mine(request)
        home = request.hop + 1 == len(request.route)
        if refusal is None and sender != (request.origin if home else request.route[request.hop + 1].peer_id):
            refusal = self._refuse(sender, request.microbatch_id, "a recompute comes only from the hop after")
        grad = await stream.read_tensor(self.activation_spec, max_bytes=self.max_activation_bytes, device=self.device)
        self.check_activation(grad)
        tokens = self.read_tokens(request.tokens, grad)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        mb = request.microbatch_id
        if mb in self.backward_done:
            return Ack(accepted=True)
        stale = self.saved.get(mb)  # we may hold its forward ourselves (an expired or refused graph)
        if stale is not None and (refusal := await self._check_gradient_sender(request, stale, sender)):
            return Ack(accepted=False, reason=refusal)  # a route the sender wrote cannot take our graph
        self.backward_done[mb] = self._expiry()
        if self.saved.pop(mb, None) is not None:
            self.live_graphs -= 1
        self.spawn(self._recompute(request, grad, tokens), f"recompute {mb}")
        return Ack(accepted=True)

    async def _recompute(self, request: RecomputeRequest, grad: torch.Tensor, tokens: torch.Tensor | None) -> None:
        started = time.monotonic()
        mb = request.microbatch_id
        source = request.origin if request.hop == 0 else request.route[request.hop - 1].peer_id
        try:
            x = await self.fetch_output(source, mb, request.hop - 1)
        except HopFailed as e:
            await self.notify_abandon(
                request.origin,
                mb,
                f"recompute of hop {request.hop}: input lost: {e}",
                lost_kind(e, AbandonReason.RECOMPUTE),
            )
            return
        if tuple(x.shape) != tuple(grad.shape):
            await self.notify_abandon(
                request.origin, mb, f"recompute of hop {request.hop}: shapes disagree", AbandonReason.RECOMPUTE
            )
            return
        x, y, calls = await self.compute(self._run_forward, x, tokens, True, priority=BACKWARD)
        nxt = request.route[request.hop + 1].stage if request.hop + 1 < len(request.route) else None
        saved = Saved(x, y, self._expiry(), request.origin, request.hop, request.step, nxt, calls=calls,
                      tokens=request.tokens)  # fmt: skip
        as_backward = BackwardRequest(
            microbatch_id=mb, origin=request.origin, step=request.step, hop=request.hop, route=request.route
        )
        self.recomputed += 1
        await self._backward(as_backward, saved, grad)
        self.recompute_s += time.monotonic() - started

    async def on_recover(self, request: RecoverRequest, sender: str) -> Ack:
        """The data node saw the peer we passed a gradient to leave: have its hop redone elsewhere."""
        kept = self.sent.get(request.microbatch_id)
        if kept is None or sender != kept.request.origin:
            return Ack(accepted=False, reason="no gradient kept for that microbatch from that data node")
        if kept.request.route[kept.request.hop].peer_id != request.lost_peer:
            return Ack(accepted=False, reason="that peer did not take this microbatch from us")
        del self.sent[request.microbatch_id]
        self.ban(request.lost_peer)
        self.spawn(self._recover(kept, request.lost_peer), f"recover {request.microbatch_id}")
        return Ack(accepted=True)

    async def _recover(self, kept: SentGradient, lost_peer: str) -> None:
        try:
            await self.delegate_recompute(
                kept.request, kept.request.hop, kept.grad, lost_peer, "it left the swarm", kept.tokens
            )
        except HopFailed as e:
            await self.notify_abandon(
                kept.request.origin, kept.request.microbatch_id, f"recover: {e}", lost_kind(e, AbandonReason.RECOVER)
            )

    async def on_resume_forward(self, request: ResumeForward, sender: str) -> Ack:
        """The data node lost the hop after ours: pass the output we keep on to the hop `route` names
        instead. Only for the microbatch as we forwarded it, from its own data node, and only to the
        stage we passed it to."""
        saved = self.saved.get(request.microbatch_id)
        computing = self.computing.get(request.microbatch_id)
        if saved is None and computing is not None:
            return self._resume_when_computed(request, computing, sender)
        if saved is None or sender != saved.origin:
            return Ack(accepted=False, reason="no output kept for that microbatch from that data node")
        route, hop = request.route, request.hop
        if not 0 <= hop < len(route) or hop != saved.hop or route[hop].peer_id != self.ctx.peer_id:
            return Ack(accepted=False, reason="that route does not name us where we forwarded it")
        if (route[hop + 1].stage if hop + 1 < len(route) else None) != saved.next_stage:
            return Ack(accepted=False, reason="that route sends it to another stage than we did")
        onward = ForwardRequest(
            microbatch_id=request.microbatch_id, origin=saved.origin, step=saved.step, hop=hop + 1, route=route,
            tokens=saved.tokens,
        )  # fmt: skip
        self.resumed += 1
        self.spawn(self._resume(onward, saved), f"resume {request.microbatch_id}")
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
        self.resumed_routes[request.microbatch_id] = route
        self.resumed += 1
        return Ack(accepted=True)

    async def _resume(self, onward: ForwardRequest, saved: Saved) -> None:
        try:
            delivered = await push_forward(self, onward, self._outgoing(saved.y.detach()))
            home = delivered.hop == len(delivered.route)
            saved.next_peer = delivered.origin if home else delivered.route[delivered.hop].peer_id
            if not home and delivered.route != onward.route:  # re-routed around a failed replica
                self.spawn(self._note_route(delivered), f"route note {onward.microbatch_id}")
        except HopFailed as e:
            await self.notify_abandon(
                onward.origin, onward.microbatch_id, f"resume after stage {self.stage}: {e}",
                lost_kind(e, AbandonReason.FORWARD),
            )  # fmt: skip

    # ---- steps and endings ------------------------------------------------------------------------

    async def on_step_close(self, close: StepClose, sender: str) -> Ack:
        """A data node's step is over. Step once every data node whose gradient we hold has closed the
        step that gradient belongs to (with one data node: exactly at its step boundary; a close that
        overtakes our own backward of its step counts when that backward is done). Every H steps of the
        data node's clock, average with a replica (NoLoCo) once our weights are final for the epoch.
        Only a data node of this run keeps that clock: anyone else could force outer steps at will."""
        if not await self._is_data_node(sender):
            return Ack(accepted=False, reason=self._refuse(sender, f"step {close.step}", "not a data node of this run"))
        heard, handled = self.closes_heard.get(sender, -1), self.closes_handled.get(sender, -1)
        if handled < close.step == heard:  # sent again while we handle it (its kept stream failed after we heard it)
            return await self._close_again(close, sender)
        await self._record_close(self.closes_heard, sender, close.step)
        try:
            await self.hooks.on_close(close.step, self.ctx.short_id)
            if close.step < self.closes_handled.get(sender, -1):  # the hold gave up on it, and a later one came
                logger.info("[%s] the close of step %d comes after that of step %d: stale, nothing to do",
                            self.ctx.short_id, close.step, self.closes_handled[sender])  # fmt: skip
                return Ack(accepted=True)
            return await self._handle_close(close, sender)
        finally:
            await self._record_close(self.closes_handled, sender, close.step)

    async def _close_again(self, close: StepClose, sender: str) -> Ack:
        """A close we are still handling is answered once handled, not handled twice at once. Once
        handled, a close sent again is handled as any (it finds nothing left to step or average), which
        is also right for a data node that restarted and redid that step before our view noticed."""
        async with self._close_news:
            if not await self._handled_in_time(sender, close.step):
                return Ack(accepted=False, reason=f"the close of step {close.step} is still being handled")
        return Ack(accepted=True)

    async def _record_close(self, record: dict[str, int], sender: str, step: int) -> None:
        async with self._close_news:
            record[sender] = max(record.get(sender, -1), step)
            self._close_news.notify_all()

    async def _handle_close(self, close: StepClose, sender: str) -> Ack:
        self.closed_step = max(self.closed_step, close.step)
        over = [mb for mb, s in self.saved.items() if s.origin == sender and s.step <= close.step]
        for mb in over:  # a lost attempt whose release never reached us: its step is over, so is it
            self._drop(mb)
        if over:
            logger.info("[%s] step %d closed: dropped %d graph(s) no gradient will reach", self.ctx.short_id,
                        close.step, len(over))  # fmt: skip
        # its microbatches all came home or were given up: no hop of theirs will need redoing. Kept until
        # expiry instead (3 min), a stage's gradients filled ~200 MiB in a 250-step benchmark run
        for mb in [
            mb for mb, kept in self.sent.items() if kept.request.origin == sender and kept.request.step <= close.step
        ]:
            del self.sent[mb]
        if sender in self.contributors:
            await self._maybe_step()
        epoch = self.averager.due(close.step) if self.averager is not None else None
        if epoch is not None:
            if self._weights_free() and not self.contributors:
                self.step_gate.clear()  # the outer step loads new weights in place, as an inner step
                try:
                    await self.averager.outer_step(epoch)
                finally:
                    self.step_gate.set()
            else:
                logger.info("[%s] outer epoch %d waits: an inner step is still pending", self.ctx.short_id, epoch)
        return Ack(accepted=True)

    async def _is_data_node(self, peer_id: str) -> bool:
        """A peer whose training microbatches we took lately (at the first hop only from the data node
        itself) or whose gradient we hold, or a live data node in our view (every live worker hears each
        step close, served or not). A data node that just joined may be missing from a view a heartbeat
        old: `listed` reads it afresh (rate-limited) for a peer it lacks."""
        if peer_id in self.served or peer_id in self.contributors:
            return True
        if any(s.origin == peer_id for s in self.saved.values()):
            return True

        def lists() -> bool:
            view = self.ctx.view
            return view is not None and any(n.peer_id == peer_id and n.role == ROLE_DATA for n in view.live_nodes())

        if lists():
            return True
        await self.listed(peer_id)  # reads the view afresh (at most so often) when it lacks the peer
        return lists()

    async def start(self) -> None:
        """Start what averaging needs beside our streams (DiLoCo: hivemind's averager), once this
        worker holds its weights; an experiment's attack is made ready first."""
        on_compute_thread = functools.partial(self.compute, priority=BACKWARD)
        attack = (self.run, self.stage, self.ctx.peer_id, WIRE_MAX_ABS, on_compute_thread)
        if await self.hooks.prepare_stage_attack(*attack):
            logger.warning("[%s] EXPERIMENT: a hostile replica of stage %d (%s)", self.ctx.short_id, self.stage,
                           self.hooks.stage_attack_name)  # fmt: skip
        if self.averager is not None:
            await self.averager.start()
        if self.edge_copy is not None:
            self.spawn(self.edge_copy.run(), "edge-copy")

    def handlers(self) -> Mapping[str, Handler]:
        return {
            "forward": self.on_forward,
            "backward": self.on_backward,
            "recompute": self.on_recompute,
            "fetch_output": self.on_fetch_output,
            "abandon": self.on_abandon,
            "recover": self.on_recover,
            "resume_forward": self.on_resume_forward,
            "step_close": self.on_step_close,
            "gossip": self.on_gossip,
            "copy_stage": self.on_copy_stage,
            "step_transcript": self.on_step_transcript,
        }

    def progress(self) -> Progress:
        averager = self.averager
        return Progress(
            inner_step=self.optimizer.step_count,
            outer_epoch=averager.epoch if averager is not None else 0,
            grad_norm=self.grad_norms.raw,
            grad_norm_clipped=self.grad_norms.clipped,
            replica_distance=averager.last_distance if averager is not None else None,
            repair=self.repair,
            averager_maddrs=tuple(averager.maddrs) if averager is not None else (),
            excluded=tuple(averager.excluded) if averager is not None else (),
        )

    async def load_state_dict(self, state: TrainedState) -> None:
        self.optimizer = await self.compute(restore_trained, self.module, state, self.run, priority=BACKWARD)
        if self.averager is not None:
            self.averager.load(outer_state_of(state, self.module), state.outer_epoch)

    async def repair_if_lost(self, silent: Collection[str] = ()) -> Repair | None:
        """Our stage has no live replica (none listed, or the listed ones are `silent` or did not give
        their weights) but the swarm has trained: rebuild it from its neighbours (CheckFree); returns
        the repair, which our record then announces."""
        dead = self.failed_donors | frozenset(silent)
        if not stage_was_lost(self, dead):
            return None
        self.repair = await repair_stage(self, dead)
        return self.repair

    async def on_step_transcript(self, request: StepTranscriptRequest, stream: FramedStream, sender: str) -> None:
        """A data node audits the inner step that took one of its microbatches (shoal.train.step_audit)."""
        if not await self._is_data_node(sender):
            reason = self._refuse(sender, request.microbatch_id, "not a data node of this run")
            await stream.write_message(Ack(accepted=False, reason=reason))
            return
        await self.transcripts.serve(request, stream)

    async def on_copy_stage(self, request: StageCopyRequest, stream: FramedStream, sender: str) -> None:
        if request.stage == 0 and self.edge_copy is not None:
            await self.edge_copy.serve(stream)  # CheckFree+: a data node rebuilding stage 0
            return
        await serve_stage_copy(self, request, stream)
        self.copies_served += 1

    async def join_by_copy(self) -> str | None:
        """Before serving a stage that has a live replica, take its weights; returns whom we copied.
        A listed donor may be dead (its record outlives it) or busy serving another joiner: each is
        skipped, and asked again or waited for (copy.py `join_stage`); the ones that failed are kept in
        `failed_donors`, so that a stage none of whose listed replicas answered is repaired, not started
        fresh."""
        attempt = await join_stage(self)
        self.failed_donors = frozenset(attempt.failed)
        return attempt.source

    async def work(self) -> dict | None:
        """A stage worker drives nothing: it serves the data nodes' microbatches until stopped."""
        return None

    def _weights_free(self) -> bool:
        """No forward graph lives or is being built, and no step is being taken: the weights may change."""
        return self.live_graphs == 0 and self.graphs_starting == 0 and self.step_gate.is_set()

    async def _maybe_step(self) -> None:
        """Step if due and no saved graph waits for its gradient: AdamW updates weights in place,
        which would corrupt the graphs of microbatches already forwarded with the old weights."""
        if not self.contributors or any(self.closes_heard.get(d, -1) < s for d, s in self.contributors.items()):
            return
        if not self._weights_free():
            return
        self.contributors = {}
        self.step_gate.clear()
        try:
            pending, self.weight_grads = self.weight_grads, []
            await asyncio.gather(*pending)
            at = self.closed_step
            await self.compute(self.transcripts.before_step, self.module, self.optimizer, priority=BACKWARD)
            stats = await self.compute(self.optimizer.step, at, priority=BACKWARD)
            if self.hooks.alters_weights:
                params = list(self.module.parameters())
                await self.compute(self.hooks.after_step, params, at, priority=BACKWARD)
            await self.compute(self.transcripts.after_step, self.module, at, self.optimizer.lr_scale, priority=BACKWARD)
        finally:
            self.step_gate.set()
        if stats.skipped:
            logger.warning("[%s] inner step %d skipped: gradient norm %s", self.ctx.short_id, stats.step,
                           stats.grad_norm)  # fmt: skip
            return
        self.grad_norms.note(stats.grad_norm, self.run.optim.grad_clip)

    async def notify_abandon(self, origin: str, microbatch_id: str, reason: str, kind: AbandonReason) -> None:
        logger.warning("[%s] %s cannot go on: %s", self.ctx.short_id, microbatch_id, reason)
        try:
            await call(
                self.ctx.p2p,
                origin,
                "rpc_abandon",
                AbandonNotice(microbatch_id=microbatch_id, reason=reason[:200], kind=kind.value),
                Ack,
                timeout_s=self.ctx.config.network.rpc_timeout_s,
            )
        except Exception as e:
            logger.info("[%s] could not tell %s: %s", self.ctx.short_id, origin[-8:], e)

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        """The data node gave this microbatch up (or is done with it): drop what we keep for it."""
        saved = self.saved.get(notice.microbatch_id)
        sent = self.sent.get(notice.microbatch_id)
        if (saved is None or saved.origin != sender) and (sent is None or sent.request.origin != sender):
            return Ack(accepted=False, reason="nothing kept for that microbatch from that data node")
        self.sent.pop(notice.microbatch_id, None)
        self._drop(notice.microbatch_id)
        return Ack(accepted=True)

    def on_view(self, view) -> None:
        """A fresh view of the swarm (each heartbeat): forget what has expired."""
        self.expire()

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """Restarted data nodes: none of what their old processes injected will come back."""
        super().on_peer_restarted(restarted, live)
        for peer in restarted:
            self.forget_origin(peer)

    def forget_origin(self, origin: str) -> int:
        """A data node restarted under the same peer id (restarts.py): none of the microbatches its old
        process injected will come back, so drop what we keep for them, as if each was abandoned."""
        stale = [mb for mb, s in self.saved.items() if s.origin == origin]
        for mb in stale:
            self._drop(mb)
        for mb in [mb for mb, kept in self.sent.items() if kept.request.origin == origin]:
            del self.sent[mb]
        for clock in (self.closes_heard, self.closes_handled, self.contributors):  # its new process counts anew
            clock.pop(origin, None)
        return len(stale)

    def expire(self) -> int:
        """Drop what we keep for microbatches whose gradient never came (abandoned downstream) or
        whose backward is long over."""
        now = time.monotonic()
        stale = [mb for mb, s in self.saved.items() if s.expires_at < now]
        for mb in stale:
            self._drop(mb)
        self.expired += len(stale)
        for kept in (self.sent, self.backward_done, self.forwarded, self.served):
            for mb in [mb for mb, v in kept.items() if (v if isinstance(v, float) else v.expires_at) < now]:
                del kept[mb]
        return len(stale)

    def _drop(self, microbatch_id: str) -> None:
        """Forget a microbatch whose gradient will never come; a pending step may then proceed."""
        if self.saved.pop(microbatch_id, None) is not None:
            self.live_graphs -= 1
            self.spawn(self._maybe_step(), "deferred step")

    # ---- hostile replicas (experiments) and the partners our averaging refused ----------------------

    def _outgoing(self, y: torch.Tensor) -> torch.Tensor:
        """The activation we pass on: ours, or what an experiment's attack makes of it."""
        return self.hooks.activation(y)

    def stats(self) -> dict:
        return {
            "forwards": self.forwards,
            "backwards": self.backwards,
            "inner_steps": self.optimizer.step_count,
            "in_flight": len(self.saved),
            "gradients_kept": len(self.sent),
            "expired": self.expired,
            "refused": self.refused,
            "steps_skipped": self.optimizer.skipped,
            "recomputed": self.recomputed,
            "recompute_s": round(self.recompute_s, 3),
            "collisions": self.compute_thread.collisions,
            "collision_s": round(self.compute_thread.collision_s, 4),
            "forwards_resumed": self.resumed,
            "recomputes_delegated": self.recomputes_delegated,
            "stream_retries": self.stream_retries,
            **self.streams.stats(),
            "copies_served": self.copies_served,
            "transcripts_served": self.transcripts.served,
            "adversary": self.hooks.stage_attack_name,
            "averaging": self.averager.stats() if self.averager is not None else {"mode": self.run.averaging.mode},
            "edge_copy": self.edge_copy.stats() if self.edge_copy is not None else None,
        }
