"""A microbatch's attempts: inject it, send its forward pass along a route, and wait for its end.

An attempt lost before its activation came home is replaced by a new one (a new wire id, the same
embedding), up to MAX_ATTEMPTS; after that, lost hops are redone in place (recovery.py). Every
microbatch ends in the ledger as completed or abandoned with a reason.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.device import to_device
from shoal.node.compute import FORWARD
from shoal.node.context import NodeContext
from shoal.node.engine import AbandonReason
from shoal.node.pipeline.base import PipelineEngine, push_forward
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.node.pipeline.data.routes import DataRoutes
from shoal.node.pipeline.hops import HopFailed, lost_kind
from shoal.planning.peer_router import Routed
from shoal.protocol.pipeline import AbandonNotice, BackwardRequest, ForwardRequest, Hop

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 8


class Outcome(enum.Enum):
    """How an attempt at a microbatch ended."""

    COMPLETED = "completed"
    RESEND = "resend"  # lost before its activation came home: the microbatch gets a new attempt
    ABANDONED = "abandoned"  # lost for good: the ledger records why


@dataclass(frozen=True)
class Ending:
    """How an attempt ended, and why."""

    outcome: Outcome
    reason: AbandonReason = AbandonReason.OTHER  # why it did not complete
    detail: str = ""  # the same in words, for the log and the progress file


COMPLETED = Ending(Outcome.COMPLETED)


@dataclass
class InFlight:
    """One attempt at one microbatch. An attempt lost before its activation came home is replaced by a
    new one (a new wire id, the same embedding); after that, lost hops are redone in place."""

    base_id: str  # the microbatch, as the ledger knows it
    embedded: torch.Tensor  # (B, T, C) with its graph back to the embedding
    targets: torch.Tensor  # (B, T)
    loss_scale: float
    done: asyncio.Future  # resolves to an Ending
    loss: float | None = None
    route_peers: tuple[str, ...] = ()
    route_stages: tuple[int, ...] = ()
    home: bool = False  # the activation came home: backward is under way
    backward: BackwardRequest | None = None  # what we sent the last hop, kept until the microbatch is over
    grad: torch.Tensor | None = None
    recovered: set[str] = field(default_factory=set)  # lost peers whose hop we already had redone
    # hops a stand-in redid in backward: what came home from them was computed by the peer it replaced
    redone: set[int] = field(default_factory=set)
    embedding_grad: bool = False  # the gradient reached the embedding
    backward_starts: tuple[float, ...] = ()  # SkipPipe's timetable: each hop's planned backward start
    step: int = 0
    train: bool = True  # a training forward: its hops keep their outputs until its backward
    recovering: int = 0  # lost hops being redone right now
    injected_at: float = field(default_factory=time.monotonic)
    capture: bool = False  # an audit or a probe: keep the activation that comes home, compute no loss
    output: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # (B, T): a Subspace Network's head rebuilds the stream from them
    packed_tokens: bytes = b""  # the same as requests carry them (b"" in any other run)


class Attempts:
    """The data node's microbatches in flight, by wire id, and the attempts that carry them.

    `hops` is the engine's hop layer (base.py: sending, re-routing, the compute thread); `head` its
    stage 0 (embedding and LM head); `note_completed` hears of each training attempt that completed
    (the step audits keep its route)."""

    def __init__(
        self,
        ctx: NodeContext,
        hops: PipelineEngine,
        head: torch.nn.Module,
        routes: DataRoutes,
        ledger: MicrobatchLedger,
        excluded: Callable[[], set[str]],
        note_completed: Callable[[str, InFlight], None],
    ):
        self.ctx, self.hops, self.head = ctx, hops, head
        self.routes, self.ledger = routes, ledger
        self.excluded = excluded
        self.note_completed = note_completed
        self.in_flight: dict[str, InFlight] = {}
        self.step_peers: set[str] = set()  # workers that served the current step: they get its StepClose

    def begin_step(self) -> None:
        self.step_peers = set()

    def end(self, wire_id: str, ending: Ending) -> None:
        """End the attempt `wire_id` if it is still in flight (a late or repeated end changes nothing)."""
        entry = self.in_flight.get(wire_id)
        if entry is not None and not entry.done.done():
            entry.done.set_result(ending)

    def note_route(self, entry: InFlight, route: tuple[Hop, ...]) -> None:
        """The route as a hop delivered it, after any re-routing or redone hop; from home on, its peers
        served this step (they hear its close)."""
        entry.route_peers = tuple(hop.peer_id for hop in route)
        if entry.backward is not None or entry.home:
            self.step_peers.update(entry.route_peers)

    def _embed(self, tokens: torch.Tensor, train: bool) -> torch.Tensor:
        """(B, T) -> (B, T, C); a training forward keeps the graph back to the embedding."""
        with torch.set_grad_enabled(train):
            return self.head.embed(tokens)

    async def microbatch(
        self,
        tag: str,
        step: int,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_scale: float,
        slots: asyncio.Semaphore,
        train: bool = True,
        index: int = 0,
    ) -> float | None:
        """Inject one microbatch and see it to its end; returns its loss if it completed.

        A forward pass lost before coming home is sent again (a new attempt); a hop lost in backward
        is redone by the hops themselves. It is abandoned only when a stage has had no live replica
        for the whole stage wait (`stage_lost`), or after MAX_ATTEMPTS forward passes."""
        base_id = f"{self.ctx.short_id}-{tag}" if train else f"{self.ctx.short_id}-eval-{tag}"
        tokens, targets = to_device(tokens, self.hops.device), to_device(targets, self.hops.device)
        if train:
            await self.routes.released(index)  # SkipPipe's timetable: this microbatch's planned release
        async with slots:
            self.ledger.inject(base_id)
            embedded = await self.hops.compute(self._embed, tokens, train, priority=FORWARD)
            last_reason = ""
            for attempt in range(MAX_ATTEMPTS):
                route = await self.routes.next(train, index)
                if route is None:
                    self.ledger.abandon(base_id, AbandonReason.STAGE_LOST, self._unroutable())
                    return None
                if train:
                    route = self.routes.swapped_for(route, step, index)
                ending, entry = await self._attempt(
                    base_id, attempt, step, embedded, tokens, targets, loss_scale, route, train
                )
                if ending.outcome is Outcome.COMPLETED:
                    self.ledger.complete(base_id)
                    return entry.loss
                if ending.outcome is Outcome.ABANDONED:
                    self.ledger.abandon(base_id, ending.reason, ending.detail)
                    return None
                last_reason = ending.detail
                self.ledger.resend(time.monotonic() - entry.injected_at)
                logger.info("[%s] %s sent again: %s", self.ctx.short_id, base_id, ending.detail[:120])
            lost = f"{MAX_ATTEMPTS} forward passes lost, last: {last_reason}"[:200]
            self.ledger.abandon(base_id, AbandonReason.ATTEMPTS, lost)
            return None

    def _unroutable(self) -> str:
        """Why no route could be found: a stage with no live replica, or none this node still trusts."""
        view = self.ctx.view
        missing = view.stages_without_replica() if view is not None else []
        if missing:
            return f"no live replica of stage(s) {missing}"
        excluded = self.excluded()
        distrusted = [s for s in range(1, self.ctx.run.pipeline.stages)
                      if view is not None and all(n.peer_id in excluded for n in view.replicas(s))]  # fmt: skip
        if distrusted:
            return f"every live replica of stage(s) {distrusted} is excluded from this node's routes"
        return "no route through the live replicas"

    async def _attempt(
        self,
        base_id: str,
        attempt: int,
        step: int,
        embedded: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_scale: float,
        routed: Routed,
        train: bool,
    ) -> tuple[Ending, InFlight]:
        wire_id = f"{base_id}#{attempt}.{secrets.token_hex(16)}"  # 128 random bits: nobody off the route can name it
        route = routed.hops
        done = asyncio.get_running_loop().create_future()
        peers, stages = tuple(p for _, p in route), tuple(s for s, _ in route)
        backward_starts = self.routes.on_the_clock(routed.backward_s)
        entry = InFlight(base_id, embedded, targets, loss_scale, done, route_peers=peers, route_stages=stages,
                         backward_starts=backward_starts, step=step, train=train, tokens=tokens,
                         packed_tokens=self.hops.pack_tokens(tokens))  # fmt: skip
        self.in_flight[wire_id] = entry
        if train:
            self.step_peers.update(entry.route_peers)
        request = ForwardRequest(
            microbatch_id=wire_id,
            origin=self.ctx.peer_id,
            step=step,
            hop=0,
            route=tuple(Hop(stage=s, peer_id=p) for s, p in route),
            needs_backward=train,
            starts=self.routes.on_the_clock(routed.forward_s),
            tokens=entry.packed_tokens,
        )
        timeout_s = self.ctx.config.limits.microbatch_timeout_s
        try:
            await push_forward(self.hops, request, embedded.detach())
            ending = await self._wait(entry, timeout_s)
            if train and ending.outcome is Outcome.COMPLETED:
                self.note_completed(wire_id, entry)
        except HopFailed as e:
            outcome = Outcome.ABANDONED if e.stage_lost else Outcome.RESEND
            ending = Ending(outcome, lost_kind(e, AbandonReason.FORWARD), f"forward into stage {route[0][0]}: {e}")
        except TimeoutError:
            outcome = Outcome.ABANDONED if entry.home else Outcome.RESEND
            where = "in backward" if entry.home else "before coming home"
            ending = Ending(outcome, AbandonReason.TIMEOUT, f"no answer {where} after {timeout_s:.0f} s")
        finally:
            self.in_flight.pop(wire_id, None)
            self.ctx.router.end(routed)
        if ending.outcome is not Outcome.COMPLETED:
            self.hops.spawn(self._release_route(wire_id, entry.route_peers, ending), f"release {wire_id}")
        return ending, entry

    async def _wait(self, entry: InFlight, timeout_s: float) -> Ending:
        """The attempt's ending, or TimeoutError after `timeout_s` without news. A hop being redone
        counts as news: that wait is bounded by the stage wait of whoever redoes it."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(entry.done), timeout_s)
            except TimeoutError:
                if entry.recovering == 0:
                    raise

    async def _release_route(self, microbatch_id: str, peers: tuple[str, ...], ending: Ending) -> None:
        """Tell the hops of a lost attempt to drop what they keep for it (their next optimizer step
        waits for such graphs), instead of holding it until it expires."""
        notice = AbandonNotice(microbatch_id=microbatch_id, reason=ending.detail[:200], kind=ending.reason.value)
        for peer in set(peers):  # banned peers too: a ban is a routing preference, and they may hold a graph
            try:
                await self.ctx.rpc.abandon(peer, notice, timeout_s=5.0)
            except Exception as e:
                logger.debug("[%s] could not release %s on %s: %s", self.ctx.short_id, microbatch_id, peer[-8:], e)
