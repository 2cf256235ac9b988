"""A data node: samples its shard, embeds, routes microbatches through the swarm, computes the
loss when an activation comes home, sends the gradient back, and steps the embedding and head.

Every microbatch it injects ends in its ledger as completed or abandoned with a reason; a step
waits for its microbatches to end (or time out), never for the whole swarm.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from shoal.device import to_device, to_host
from shoal.errors import UsageError
from shoal.logs import printable
from shoal.model.hf import initial_stage
from shoal.model.split_backward import WeightGrads
from shoal.node.averaging.base import Averager
from shoal.node.averaging.modes import AVERAGERS
from shoal.node.compute import BACKWARD, FORWARD, WEIGHT_GRAD
from shoal.node.context import NodeContext
from shoal.node.engine import (
    AbandonReason,
    GradNorms,
    Handler,
    Progress,
    TrainedState,
    outer_state_of,
    restore_trained,
)
from shoal.node.pipeline.data.auditor import Auditor
from shoal.node.pipeline.data.gradients import GradientExchange
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.node.pipeline.data.probes import run_probes
from shoal.node.pipeline.data.progress import ProgressFile, StageWatch
from shoal.node.pipeline.data.routes import DataRoutes
from shoal.node.pipeline.data.step_audits import StepAuditor
from shoal.node.pipeline.hops import (
    HopFailed,
    PipelineEngine,
    lost_kind,
    push_forward,
    step_close_patience_s,
)
from shoal.node.stage.copy import join_stage, serve_stage_copy
from shoal.node.stage.edge_copy import recover_stage0
from shoal.p2p.transport import FramedStream, call, pooled_call
from shoal.planning.observed import Trip
from shoal.planning.peer_router import Routed
from shoal.planning.swarm_view import SwarmView
from shoal.protocol.pipeline import (
    AbandonNotice,
    Ack,
    BackwardRequest,
    ForwardRequest,
    GradientShare,
    Hop,
    OutputRequest,
    RecoverRequest,
    ResumeForward,
    RouteNote,
    StageCopyRequest,
    StepClose,
    check_hop,
)
from shoal.train.data import BatchSampler, load_token_splits, validation_batches
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """One attempt at one microbatch. An attempt lost before its activation came home is replaced by a
    new one (a new wire id, the same embedding); after that, lost hops are redone in place."""

    base_id: str  # the microbatch, as the ledger knows it
    embedded: torch.Tensor  # (B, T, C) with its graph back to the embedding
    targets: torch.Tensor  # (B, T)
    loss_scale: float
    done: asyncio.Future  # resolves to an Outcome
    loss: float | None = None
    route_peers: tuple[str, ...] = ()
    route_stages: tuple[int, ...] = ()
    home: bool = False  # the activation came home: backward is under way
    backward: BackwardRequest | None = None  # what we sent the last hop, kept until the microbatch is over
    grad: torch.Tensor | None = None
    recovered: set[str] = field(default_factory=set)  # lost peers whose hop we already had redone
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


@dataclass(frozen=True)
class Outcome:
    kind: str  # "completed", "resend" or "abandoned"
    reason: AbandonReason = AbandonReason.OTHER  # why it did not complete
    detail: str = ""  # the same in words, for the log and the progress file


COMPLETED = Outcome("completed")
MAX_ATTEMPTS = 8
TRIPS_KEPT = 256  # the latest forward trips the observed hop times are fitted to


@dataclass
class StepResult:
    step: int
    loss: float | None
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)


class DataDriver(PipelineEngine):
    def __init__(self, ctx: NodeContext, shard: int = 0, num_shards: int = 1, progress_path: str | None = None):
        super().__init__(ctx)
        run = self.run
        if run.model.checkpoint and ctx.checkpoint is None:  # its tokenizer, embedding and head are there
            raise UsageError(f"a data node of run {run.name} needs the checkpoint it starts from: --checkpoint DIR")
        self.head = initial_stage(run.model, run.pipeline.stages, 0, run.train.seed, ctx.checkpoint).to(ctx.device)
        self.optimizer = InnerOptimizer(self.head, run.optim, run.train.steps)
        self.hooks = ctx.hooks
        # stage 0's replicas are the data nodes: they average it as any stage's replicas do
        averager_type = AVERAGERS.get(run.averaging.mode)
        self.averager: Averager | None = averager_type(ctx, self) if averager_type is not None else None
        shares = averager_type is not None and run.averaging.stage0 == "gradients"
        self.gradients = GradientExchange(ctx, self) if shares else None  # before each step (gradients.py)
        self.shard, self.num_shards = shard, num_shards
        self.ledger = MicrobatchLedger()
        self.in_flight: dict[str, InFlight] = {}
        self.load: Counter = Counter()
        self.history: list[StepResult] = []
        self.splits = None
        self.sampler: BatchSampler | None = None
        self.finished = asyncio.Event()
        self.summary: dict = {}
        self.loss: float | None = None  # the last step's training loss
        self.grad_norms = GradNorms()
        self.step_peers: set[str] = set()  # workers that served the current step: they get its StepClose
        self.refused = 0  # requests a peer was not entitled to send
        self.recent_trips: deque[Trip] = deque(maxlen=TRIPS_KEPT)  # forward trips, for routing by observed speed
        self.current_step = 0
        self.first_step = 0  # resumed from --state-dir: the steps before it are done (state_keeper.py)
        self.auditor = Auditor(self)  # audits of stage replicas, and the replicas excluded for good
        self.step_audits = StepAuditor(self)  # replays of a replica's inner step (step_audits.py)
        self.routes = DataRoutes(ctx, self.banned, self.auditor.excluded_peers)
        self.progress_file = ProgressFile(progress_path)
        self.stage_watch = StageWatch(ctx, self.progress_file, self.ledger)
        self.weight_grads: list[asyncio.Future] = []  # the LM head's deferred W passes of this step
        self.closing: asyncio.Future | None = None  # the workers' answers to our last step close

    movable = False  # a data node keeps its shard, embedding and head
    stage = 0

    @property
    def module(self) -> torch.nn.Module:
        return self.head

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    async def start(self) -> None:
        """Load and tokenize this node's data (on the compute thread): training starts with `run`."""
        run = self.run
        tokenizer = self.ctx.checkpoint.tokenizer_file if self.ctx.checkpoint is not None else None
        self.splits = await self.compute(load_token_splits, run.data, run.model.vocab_size, tokenizer)
        self.sampler = BatchSampler(
            self.splits.train, run.train.seq_len, run.train.batch_size, run.train.seed, self.shard, self.num_shards
        )
        if self.averager is not None:
            await self.averager.start()

    async def wait_for_pipeline(self, poll_s: float = 0.5, report_s: float = 10.0) -> None:
        """Until every block stage has a live replica; says which are missing while it waits."""
        last_report = time.monotonic()

        def say_what_is_missing(view: SwarmView | None, waited_s: float) -> None:
            nonlocal last_report
            if view is not None and time.monotonic() - last_report >= report_s:
                missing = view.stages_without_replica()
                logger.warning(
                    "[%s] waiting %.0f s for a replica of stage(s) %s before training",
                    self.ctx.short_id,
                    waited_s,
                    missing,
                )
                last_report = time.monotonic()

        await self.ctx.wait_for(
            lambda view: True if not view.stages_without_replica() else None,
            None,
            poll_s=poll_s,
            fresh=True,
            while_waiting=say_what_is_missing,
        )

    # ---- the training loop ---------------------------------------------------------------------

    async def train(self) -> dict:
        """Train the run's steps from `first_step`; returns the summary (also the progress file's last line)."""
        assert self.sampler is not None, "start() first"
        await self.wait_for_pipeline()
        started = time.monotonic()
        self.progress_file.write({"event": "start", "peer_id": self.ctx.peer_id, "run_id": self.run.run_id})
        self.spawn(self.stage_watch.run(self.finished, lambda: self.current_step), "watch stages")
        for step in range(self.first_step, self.run.train.steps):
            self.current_step = step
            result = await self.train_step(step)
            self.history.append(result)
            self.loss = result.loss
            validation = {}
            if self.run.train.evaluates_after(step):
                await self.closes_taken()  # every worker evaluates on this step's weights
                validation = {"val_loss": await self.evaluate(f"s{step}")}
            self.progress_file.write(
                {
                    "event": "step",
                    "step": step,
                    "loss": result.loss,
                    "tokens": result.tokens,
                    "step_s": result.seconds,
                    "elapsed_s": time.monotonic() - started,
                    "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                    "in_flight": self.ledger.in_flight,
                    "swapped": self.routes.swapped,
                    **validation,
                    **self.ledger.summary(),
                    **result.extra,
                }
            )
        await self.closes_taken()  # evaluation and probes see every worker's last step
        self.auditor.on_view(await self.ctx.refresh_view())  # exclusions workers just published count too
        val_loss = await self.evaluate()
        probe = await self.probe()
        losses = [r.loss for r in self.history if r.loss is not None]
        tail = losses[-5:]
        self.summary = {
            "steps": len(self.history),
            "initial_loss": losses[0] if losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": val_loss,
            "probe": probe,
            "audit": self.auditor.stats(),
            "step_audit": self.step_audits.stats(),
            "train_s": time.monotonic() - started,
            "tokens_per_s": sum(r.tokens for r in self.history) / max(sum(r.seconds for r in self.history), 1e-9),
            **self.ledger.summary(),
        }
        self.progress_file.write({"event": "done", **self.summary})
        self.finished.set()
        return self.summary

    async def train_step(self, step: int) -> StepResult:
        assert self.sampler is not None
        started = time.monotonic()
        inputs, targets = self.sampler.batch(step)
        n_micro = self.run.microbatches_per_step
        slots = asyncio.Semaphore(self.ctx.max_inflight)
        self.step_peers = set()
        self.step_audits.begin()
        await self.routes.begin_step(step)
        if self.routes.swarm_changed:  # what SkipPipe planned over, for the simulator to replay (benchmarks)
            self.progress_file.write({"event": "planned_over", "step": step, "timetable": self.run.skippipe.timetable,
                                      "swarm": asdict(self.routes.planned_over)})  # fmt: skip
        pieces = zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True)
        jobs = [
            asyncio.create_task(self._microbatch(f"{step}.{i}", step, x, y, 1.0 / n_micro, slots, index=i))
            for i, (x, y) in enumerate(pieces)
        ]
        audit = self.auditor.maybe_audit(step, inputs[: self.run.train.microbatch_size])  # beside the step's work
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        if audit is not None:
            await audit
        await self._weight_grads_done()
        await self.closes_taken()  # the last step's: one close in flight at a time
        self.closing = self.close_step(step, completed=len(losses), abandoned=n_micro - len(losses))
        self.step_audits.finish(step, self.closing)
        if self.gradients is not None:  # stage 0's gradients: the mean of ours and another data node's
            await self.gradients.exchange(step)
        stats = await self.compute(self.optimizer.step, step)  # while the workers take theirs
        epoch = self.averager.due(step) if self.averager is not None else None
        if epoch is not None:  # stage 0 averages with the other data nodes (every step, by default)
            await self.averager.outer_step(epoch)
        if self.workers_average_after(step):  # the next step starts on the block stages' outer step
            await self.closes_taken()
        if stats.skipped:
            logger.warning("[%s] step %d skipped: gradient norm %s", self.ctx.short_id, step, stats.grad_norm)
        else:
            self.grad_norms.note(stats.grad_norm, self.run.optim.grad_clip)
        tokens_per_microbatch = inputs.numel() // n_micro
        return StepResult(
            step=step,
            loss=sum(losses) / len(losses) if losses else None,
            tokens=len(losses) * tokens_per_microbatch,
            seconds=time.monotonic() - started,
            extra={
                "lr": stats.lr,
                "audits": self.auditor.audits,
                "excluded": len(self.auditor.excluded),
                **(
                    {"plan": self.routes.plan_digest, "full_pass": self.routes.full_pass}
                    if self.routes.skippipe
                    else {}
                ),
            },
        )

    async def _weight_grads_done(self) -> None:
        pending, self.weight_grads = self.weight_grads, []
        await asyncio.gather(*pending)

    def workers_average_after(self, step: int) -> bool:
        averaging = self.run.averaging
        return averaging.mode != "none" and (step + 1) % averaging.inner_steps == 0

    async def closes_taken(self) -> None:
        """Every worker has answered our last step close (or failed to)."""
        if self.closing is not None:
            await asyncio.shield(self.closing)

    def close_step(self, step: int, completed: int, abandoned: int) -> asyncio.Future:
        """Tell the workers that this step is over; returns the task that waits for their answers.

        The next step need not wait for them: a worker holds a forward of step s until it has handled
        our close of step s-1 (stepped and, every H steps, averaged), so it never runs on stale
        weights, while our embedding and first hop of the next step overlap its inner step. The close
        goes out on a stream of its own and may arrive after the forwards it precedes; that stream is
        kept for the next step's close, since opening one (a round trip and a protocol negotiation)
        would lie on every step's critical path: the worker's step, and so the next forward, waits for it."""
        close = StepClose(step=step, completed=completed, abandoned=abandoned)
        view = self.ctx.view
        live = {n.peer_id for n in view.live_nodes()} if view is not None else set()
        workers = {n.peer_id for n in view.live_nodes() if n.stage > 0} if view is not None else set()
        # every live worker hears it: replicas that served nothing this step still keep the outer-epoch clock
        peers = sorted(p for p in self.step_peers | workers if p in live or not live)

        async def tell(peer: str) -> None:
            await self.ctx.hooks.before_close_sent()  # fault injection: the next step's forwards overtake it
            try:
                timeout_s = step_close_patience_s(self.run.averaging.exchange_timeout_s)
                await pooled_call(self.streams, peer, "rpc_step_close", close, Ack, timeout_s)
            except Exception as e:
                logger.info("[%s] step %d close not taken by %s: %s", self.ctx.short_id, step, peer[-8:], e)

        return self.spawn(asyncio.gather(*(tell(peer) for peer in peers)), f"close step {step}")

    @torch.no_grad()
    def embed_eval(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed(to_device(tokens, self.device))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return self.head.embed(tokens)

    async def _microbatch(
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
        tokens, targets = to_device(tokens, self.device), to_device(targets, self.device)
        if train:
            await self.routes.released(index)  # SkipPipe's timetable: this microbatch's planned release
        async with slots:
            self.ledger.inject(base_id)
            embedded = await self.compute(self._embed if train else self.embed_eval, tokens, priority=FORWARD)
            last_reason = ""
            for attempt in range(MAX_ATTEMPTS):
                route = await self.routes.next(train, index)
                if route is None:
                    self.ledger.abandon(base_id, AbandonReason.STAGE_LOST, self._unroutable())
                    return None
                if train:
                    route = self.routes.swapped_for(route, step, index)
                outcome, entry = await self._attempt(
                    base_id, attempt, step, embedded, tokens, targets, loss_scale, route, train
                )
                if outcome.kind == "completed":
                    self.ledger.complete(base_id)
                    return entry.loss
                if outcome.kind == "abandoned":
                    self.ledger.abandon(base_id, outcome.reason, outcome.detail)
                    return None
                last_reason = outcome.detail
                self.ledger.resend(time.monotonic() - entry.injected_at)
                logger.info("[%s] %s sent again: %s", self.ctx.short_id, base_id, outcome.detail[:120])
            lost = f"{MAX_ATTEMPTS} forward passes lost, last: {last_reason}"[:200]
            self.ledger.abandon(base_id, AbandonReason.ATTEMPTS, lost)
            return None

    def _unroutable(self) -> str:
        """Why no route could be found: a stage with no live replica, or none this node still trusts."""
        view = self.ctx.view
        missing = view.stages_without_replica() if view is not None else []
        if missing:
            return f"no live replica of stage(s) {missing}"
        excluded = self.auditor.excluded_peers()
        distrusted = [s for s in range(1, self.run.pipeline.stages)
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
    ) -> tuple[Outcome, InFlight]:
        wire_id = f"{base_id}#{attempt}.{secrets.token_hex(16)}"  # 128 random bits: nobody off the route can name it
        route = routed.hops
        done = asyncio.get_running_loop().create_future()
        peers, stages = tuple(p for _, p in route), tuple(s for s, _ in route)
        backward_starts = self.routes.on_the_clock(routed.backward_s)
        entry = InFlight(base_id, embedded, targets, loss_scale, done, route_peers=peers, route_stages=stages,
                         backward_starts=backward_starts, step=step, train=train, tokens=tokens,
                         packed_tokens=self.pack_tokens(tokens))  # fmt: skip
        self.in_flight[wire_id] = entry
        self.load.update(entry.route_peers)
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
            await push_forward(self, request, embedded.detach())
            outcome = await self._wait(entry, timeout_s)
            if train and outcome.kind == "completed":
                self.step_audits.note_completed(wire_id, entry)
        except HopFailed as e:
            kind = "abandoned" if e.stage_lost else "resend"
            outcome = Outcome(kind, lost_kind(e, AbandonReason.FORWARD), f"forward into stage {route[0][0]}: {e}")
        except TimeoutError:
            kind = "abandoned" if entry.home else "resend"
            where = "in backward" if entry.home else "before coming home"
            outcome = Outcome(kind, AbandonReason.TIMEOUT, f"no answer {where} after {timeout_s:.0f} s")
        finally:
            self.in_flight.pop(wire_id, None)
            self.load.subtract(entry.route_peers)
            self.ctx.router.end(routed)
        if outcome.kind != "completed":
            self.spawn(self._release_route(wire_id, entry.route_peers, outcome), f"release {wire_id}")
        return outcome, entry

    async def _wait(self, entry: InFlight, timeout_s: float) -> Outcome:
        """The attempt's outcome, or TimeoutError after `timeout_s` without news. A hop being redone
        counts as news: that wait is bounded by the stage wait of whoever redoes it."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(entry.done), timeout_s)
            except TimeoutError:
                if entry.recovering == 0:
                    raise

    def _end(self, wire_id: str, outcome: Outcome) -> None:
        entry = self.in_flight.get(wire_id)
        if entry is not None and not entry.done.done():
            entry.done.set_result(outcome)

    async def _release_route(self, microbatch_id: str, peers: tuple[str, ...], outcome: Outcome) -> None:
        """Tell the hops of a lost attempt to drop what they keep for it (their next optimizer step
        waits for such graphs), instead of holding it until it expires."""
        notice = AbandonNotice(microbatch_id=microbatch_id, reason=outcome.detail[:200], kind=outcome.reason.value)
        for peer in set(peers):  # banned peers too: a ban is a routing preference, and they may hold a graph
            try:
                await call(self.ctx.p2p, peer, "rpc_abandon", notice, Ack, timeout_s=5.0)
            except Exception as e:
                logger.debug("[%s] could not release %s on %s: %s", self.ctx.short_id, microbatch_id, peer[-8:], e)

    # ---- RPC handlers: an activation coming home, a gradient reaching the embedding ------------

    async def on_forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        check_hop(request)
        x = await self.read_activation(stream)
        entry = self.in_flight.get(request.microbatch_id)
        if request.hop != len(request.route) or request.origin != self.ctx.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None:
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        if not request.route or not await self._speaks_for_hop(entry, sender, request.route[-1]):
            return Ack(accepted=False, reason=self._refuse(sender, request.microbatch_id, "not the last hop"))
        if entry.home:
            return Ack(accepted=True)  # a retried stream: we already have it
        if tuple(x.shape[:2]) != tuple(entry.targets.shape):
            return Ack(accepted=False, reason=f"activation shape {tuple(x.shape)} does not match the microbatch")
        if entry.capture:  # an audit's or a probe's forward: the activation itself is the answer
            entry.home, entry.output = True, x
            self._end(request.microbatch_id, COMPLETED)
            return Ack(accepted=True)
        entry.home = True
        self._note_route(entry, request.route)  # as delivered, after any re-routing
        self.recent_trips.append(Trip(entry.route_peers, time.monotonic() - entry.injected_at))
        self.spawn(self._loss_and_backward(request, entry, x), f"loss {request.microbatch_id}")
        return Ack(accepted=True)

    def _note_route(self, entry: InFlight, route: tuple[Hop, ...]) -> None:
        entry.route_peers = tuple(hop.peer_id for hop in route)
        if entry.backward is not None or entry.home:
            self.step_peers.update(entry.route_peers)

    def _loss_and_grad(
        self, entry: InFlight, x: torch.Tensor, train: bool
    ) -> tuple[float, torch.Tensor | None, WeightGrads | None]:
        if not train:
            with torch.no_grad():
                return float(self.head.loss(x, entry.targets, entry.tokens)), None, None
        return self.head.loss_and_input_grad(x, entry.targets, entry.loss_scale, entry.tokens)

    async def _loss_and_backward(self, request: ForwardRequest, entry: InFlight, x: torch.Tensor) -> None:
        if request.needs_backward:
            self.step_audits.note_output(request.microbatch_id, x)
        entry.loss, grad, weight_grad = await self.compute(
            self._loss_and_grad, entry, x, request.needs_backward, priority=BACKWARD
        )
        if grad is None:
            self._end(request.microbatch_id, COMPLETED)
            return
        assert weight_grad is not None
        # the last block stage waits for `grad`, nobody for the LM head's weight gradient: it runs when
        # this node has nothing more urgent, at the latest before the optimizer step
        self.weight_grads.append(self.compute_thread.run(WEIGHT_GRAD, weight_grad.accumulate))
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
            await self.send(target, "rpc_backward", entry.backward, grad)
        except HopFailed as e:
            self.ban(target, e)
            entry.recovered.add(target)
            await self._redo_hop(request.microbatch_id, entry, target, str(e))

    async def _redo_hop(self, wire_id: str, entry: InFlight, lost_peer: str, why: str) -> None:
        """The last hop is gone with its graph: another replica of its stage redoes it."""
        assert entry.backward is not None and entry.grad is not None
        entry.recovering += 1
        try:
            await self.delegate_recompute(
                entry.backward, entry.backward.hop, entry.grad, lost_peer, why, entry.packed_tokens
            )
            self.ledger.recoveries += 1
        except HopFailed as e:
            where = f"backward into stage {entry.backward.route[-1].stage}: {e}"
            self._end(wire_id, Outcome("abandoned", lost_kind(e, AbandonReason.BACKWARD), where))
        finally:
            entry.recovering -= 1

    async def on_backward(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        check_hop(request)
        entry = self.in_flight.get(request.microbatch_id)
        spec = replace(self.activation_spec, shape=tuple(entry.embedded.shape)) if entry else self.activation_spec
        grad = await stream.read_tensor(spec, max_bytes=self.max_activation_bytes, device=self.device)
        if request.hop != -1 or request.origin != self.ctx.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None or not entry.home:
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        if not request.route or not await self._speaks_for_hop(entry, sender, request.route[0]):
            return Ack(accepted=False, reason=self._refuse(sender, request.microbatch_id, "not the first hop"))
        if entry.done.done() or entry.embedding_grad:
            return Ack(accepted=True)  # a retried stream
        entry.embedding_grad = True
        self.ctx.router.returned(self.ctx.peer_id, request.route[0].peer_id)
        self._note_route(entry, request.route)  # with any hop redone by a replacement
        self.spawn(self._embedding_backward(request.microbatch_id, entry, grad), f"embed-bwd {request.microbatch_id}")
        return Ack(accepted=True)

    async def _embedding_backward(self, microbatch_id: str, entry: InFlight, grad: torch.Tensor) -> None:
        await self.compute(entry.embedded.backward, grad, priority=BACKWARD)
        self._end(microbatch_id, COMPLETED)

    async def on_fetch_output(self, request: OutputRequest, stream: FramedStream, sender: str) -> None:
        """A replica redoing the first hop asks for its input again: the embedding we sent."""
        entry = self.in_flight.get(request.microbatch_id)
        if entry is None or request.hop != -1 or not await self.listed(sender):
            await self.serve_output(None, "no output kept for that microbatch and hop", stream)
            return
        await self.serve_output(entry.embedded.detach(), "", stream)

    def on_view(self, view) -> None:
        """A fresh view of the swarm (each heartbeat): act on microbatches that lost a peer."""
        self.reap_lost({n.peer_id for n in view.live_nodes()})
        self.auditor.on_view(view)

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """What went through restarted peers' old processes is lost with them, as if they had left."""
        super().on_peer_restarted(restarted, live)
        self.reap_lost(live - restarted)

    def reap_lost(self, live_peers: set[str]) -> int:
        """Act on in-flight microbatches routed through a peer that left the swarm (its record expired
        or says `leaving`): before coming home, resume the forward pass from the nearest hop upstream
        of the lost one that keeps its output, or send it again; in backward, have the hop after the
        lost one pass its kept gradient to another replica of the lost stage."""
        count = 0
        for wire_id, entry in list(self.in_flight.items()):
            lost = [p for p in entry.route_peers if p not in live_peers]
            if not lost:
                continue
            count += 1
            if not entry.home:
                if not set(lost) <= entry.recovered:
                    entry.recovered.update(lost)
                    self.spawn(self._resume_forward(wire_id, entry, set(lost), live_peers), f"resume {wire_id}")
                continue
            for peer in lost:
                if peer not in entry.recovered:
                    entry.recovered.add(peer)
                    self.spawn(self._recover(wire_id, entry, peer), f"recover {wire_id}")
        return count

    async def _resume_forward(self, wire_id: str, entry: InFlight, lost: set[str], live: set[str]) -> None:
        """GWTF's recovery in forward: the lost hops get replicas of their stages, and the nearest hop
        upstream of the first lost one that keeps its output passes it on along the new route (the data
        node's own embedding when the first hop was lost). Only if no hop can, the forward pass is
        sent again from the start (a new attempt)."""
        why = f"peer {next(iter(lost))[-8:]} left the swarm"
        first = min(i for i, p in enumerate(entry.route_peers) if p in lost)
        route = list(zip(entry.route_stages, entry.route_peers, strict=True))
        avoid = lost | self.banned()
        for pos in range(first, len(route)):
            stage, peer = route[pos]
            if peer in lost:
                prev = route[pos - 1][1] if pos else self.ctx.peer_id
                nxt = route[pos + 1][1] if pos + 1 < len(route) else self.ctx.peer_id
                replica = self.ctx.router.replace(stage, prev, nxt, avoid) if entry.train else None
                if replica is None:
                    self._end(wire_id, Outcome("resend", AbandonReason.FORWARD, why))
                    return
                route[pos] = (stage, replica)
        hops = tuple(Hop(stage=s, peer_id=p) for s, p in route)
        resumed = False
        for upstream in range(first - 1, -1, -1):
            if route[upstream][1] not in live:
                continue
            request = ResumeForward(microbatch_id=wire_id, hop=upstream, route=hops)
            try:
                ack = await call(self.ctx.p2p, route[upstream][1], "rpc_resume_forward", request, Ack, timeout_s=5.0)
            except Exception as e:
                logger.info("[%s] resume %s at hop %d: %s", self.ctx.short_id, wire_id, upstream, e)
                continue
            if ack.accepted:
                resumed = True
                break
        if not resumed and first == 0 and entry.train:
            request = ForwardRequest(microbatch_id=wire_id, origin=self.ctx.peer_id, step=entry.step, hop=0, route=hops,
                                     tokens=entry.packed_tokens)  # fmt: skip
            try:
                await push_forward(self, request, entry.embedded.detach())
                resumed = True
            except HopFailed as e:
                logger.info("[%s] resume %s from its embedding: %s", self.ctx.short_id, wire_id, e)
        if entry.done.done():
            return
        if not resumed:
            self._end(wire_id, Outcome("resend", AbandonReason.FORWARD, why))
            return
        self.load.subtract(entry.route_peers)
        entry.route_peers = tuple(p for _, p in route)
        self.load.update(entry.route_peers)
        self.ledger.resumed += 1
        logger.info("[%s] %s resumed after %s", self.ctx.short_id, wire_id, why)

    async def _recover(self, wire_id: str, entry: InFlight, lost_peer: str) -> None:
        assert entry.backward is not None
        route = entry.backward.route
        where = [i for i, hop in enumerate(route) if hop.peer_id == lost_peer]
        if not where:
            return
        if where[-1] == len(route) - 1:
            await self._redo_hop(wire_id, entry, lost_peer, "it left the swarm")
            return
        downstream = route[where[-1] + 1].peer_id
        notice = RecoverRequest(microbatch_id=wire_id, lost_peer=lost_peer)
        try:
            ack = await call(self.ctx.p2p, downstream, "rpc_recover", notice, Ack, timeout_s=5.0)
            if ack.accepted:  # the hop after the lost one has it redone: wait for that, within bounds
                self.ledger.recoveries += 1
                entry.recovering += 1
                grace = self.ctx.config.limits.stage_wait_s + self.ctx.config.limits.microbatch_timeout_s
                asyncio.get_running_loop().call_later(grace, self._recovered, entry)
        except Exception as e:
            logger.info("[%s] recover %s via %s: %s", self.ctx.short_id, wire_id, downstream[-8:], e)

    @staticmethod
    def _recovered(entry: InFlight) -> None:
        entry.recovering -= 1

    async def _speaks_for_hop(self, entry: InFlight, sender: str, hop: Hop) -> bool:
        """`sender` is the peer that `hop` names, and it took part in this microbatch: it is on the
        route we know, or a live replica of that hop's stage that redid it (a re-route or a recompute)."""
        if sender != hop.peer_id:
            return False
        return sender in entry.route_peers or await self.listed(sender, (hop.stage,))

    def _refuse(self, sender: str, microbatch_id: str, why: str) -> str:
        self.refused += 1
        logger.warning("[%s] refused %s from %s: %s", self.ctx.short_id, microbatch_id[:96], sender[-8:], why)
        return why

    async def on_route_note(self, note: RouteNote, sender: str) -> Ack:
        """A hop of this microbatch's forward sent it on to another peer than the route named (it picks
        the next hop itself, or re-routed): note the peer, so a resume starts from the right hop. Taken
        only from a hop of it or a replica of the stage before, naming a replica of the stage noted."""
        entry = self.in_flight.get(note.microbatch_id)
        if entry is None or entry.done.done() or entry.home or not 0 < note.hop < len(entry.route_peers):
            return Ack(accepted=False, reason="unknown microbatch, or not in forward")
        if entry.route_stages[note.hop] != note.stage:
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "a note for another stage"))
        before = (entry.route_stages[note.hop - 1],)
        if sender != entry.route_peers[note.hop - 1] and not await self.listed(sender, before):
            return Ack(accepted=False, reason=self._refuse(sender, note.microbatch_id, "not the hop before"))
        if not await self.listed(note.peer_id, (note.stage,)):
            return Ack(accepted=False, reason="the peer noted holds no replica of that stage")
        old = entry.route_peers[note.hop]
        if old != note.peer_id:
            entry.route_peers = tuple(note.peer_id if i == note.hop else p for i, p in enumerate(entry.route_peers))
            self.load.subtract([old])
            self.load.update([note.peer_id])
        return Ack(accepted=True)

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        """A hop of this microbatch (on its route, or a replica of one of its stages that redid a hop)
        says it cannot go on. Its reason is a peer's text: made printable before we log or keep it."""
        entry = self.in_flight.get(notice.microbatch_id)
        if entry is None or entry.done.done():
            return Ack(accepted=False, reason="unknown microbatch")
        if sender not in entry.route_peers and not await self.listed(sender, entry.route_stages):
            return Ack(accepted=False, reason=self._refuse(sender, notice.microbatch_id, "not a hop of it"))
        reason = AbandonReason.parse(notice.kind)
        lost_for_good = entry.home or reason is AbandonReason.STAGE_LOST
        detail = printable(notice.reason, 200)
        self._end(notice.microbatch_id, Outcome("abandoned" if lost_for_good else "resend", reason, detail))
        return Ack(accepted=True)

    # ---- evaluation ----------------------------------------------------------------------------

    async def evaluate(self, tag: str = "end") -> float | None:
        """Validation loss of the whole swarm model, forward only, over the shared validation batches
        (None if none came home). `tag` keeps each evaluation's microbatch ids apart."""
        t = self.run.train
        slots = asyncio.Semaphore(self.ctx.max_inflight)
        jobs = []
        for b, (x, y) in enumerate(validation_batches(self.splits.val, t.seq_len, t.batch_size, t.eval_batches)):
            for i, (xm, ym) in enumerate(
                zip(x.chunk(self.run.microbatches_per_step), y.chunk(self.run.microbatches_per_step), strict=True)
            ):
                jobs.append(self._microbatch(f"{tag}.{b}.{i}", -1, xm, ym, 1.0, slots, train=False))
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        return sum(losses) / len(losses) if losses else None

    # ---- audits and probes: activations that come home as they are -----------------------------

    def banned(self) -> set[str]:
        """Peers that just failed us, and replicas our audits excluded for good."""
        return super().banned() | self.auditor.excluded_peers()

    # ---- what the node asks of its engine (engine.py) ------------------------------------------------

    def handlers(self) -> Mapping[str, Handler]:
        return {
            "forward": self.on_forward,
            "backward": self.on_backward,
            "fetch_output": self.on_fetch_output,
            "abandon": self.on_abandon,
            "route_note": self.on_route_note,
            "copy_stage": self.on_copy_stage,
            "gossip": self.on_gossip,
            "gradient_share": self.on_gradient_share,
        }

    async def on_gradient_share(self, request: GradientShare, stream: FramedStream, sender: str) -> Ack | None:
        if self.gradients is None:
            return Ack(accepted=False, reason="this data node does not average stage-0 gradients")
        return await self.gradients.on_share(request, stream, sender)

    def progress(self) -> Progress:
        averager = self.averager
        return Progress(
            inner_step=self.optimizer.step_count,
            outer_epoch=averager.epoch if averager is not None else 0,
            replica_distance=averager.last_distance if averager is not None else None,
            averager_maddrs=tuple(averager.maddrs) if averager is not None else (),
            loss=self.loss,
            grad_norm=self.grad_norms.raw,
            grad_norm_clipped=self.grad_norms.clipped,
            waiting_for=tuple(self.stage_watch.waiting_for),
            excluded=tuple(self.auditor.record()),
        )

    def trips(self) -> Sequence[Trip]:
        return list(self.recent_trips)

    async def load_state_dict(self, state: TrainedState) -> None:
        """Go on from a save: its weights and optimizer, and its step (a step's batch is a pure function
        of run, shard and step, so the step is this node's position in its data)."""
        self.optimizer = await self.compute(restore_trained, self.head, state, self.run, priority=BACKWARD)
        if self.averager is not None:
            self.averager.load(outer_state_of(state, self.head), state.outer_epoch)
        self.first_step = state.inner_step

    async def on_copy_stage(self, request: StageCopyRequest, stream: FramedStream, sender: str) -> None:
        """Stage 0's weights, for `shoal export` (a data node's embedding and head are copied by no node)."""
        await serve_stage_copy(self, request, stream)

    async def join_by_copy(self) -> str | None:
        """Where the run averages stage 0, a data node joining a run that has stepped copies it from
        the most trained live data node, and goes on from that node's step (NoLoCo pairs replicas of
        the same outer epoch, and epochs follow steps); its batches are still its own shard's. Where no
        data node gave it and the run repairs with CheckFree+, it takes the copy stage 0's neighbours
        keep (edge_copy.py)."""
        source = None
        if self.averager is not None:
            source = (await join_stage(self)).source
        if source is None:
            source = await recover_stage0(self)
        if source is not None:
            self.first_step = self.optimizer.step_count
        return source

    async def work(self) -> dict | None:
        return await self.train()

    async def forward_through(
        self, hops: tuple[tuple[int, str], ...], x: torch.Tensor, tokens: torch.Tensor, tag: str
    ) -> torch.Tensor | None:
        """An evaluation forward of `x` (B, T, C), the activation of `tokens` (B, T), through exactly
        these (stage, peer) hops, whose output comes home as it is instead of into a loss; None if it
        did not come. No re-routing: an audit must hear from the replica it names."""
        wire_id = f"{self.ctx.short_id}-{tag}#{secrets.token_hex(16)}"
        done = asyncio.get_running_loop().create_future()
        blank = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)  # no targets: only the shape is checked
        peers, stages = tuple(p for _, p in hops), tuple(s for s, _ in hops)
        entry = InFlight(tag, x, blank, 1.0, done, route_peers=peers, route_stages=stages, capture=True)
        self.in_flight[wire_id] = entry
        route = tuple(Hop(stage=s, peer_id=p) for s, p in hops)
        request = ForwardRequest(microbatch_id=wire_id, origin=self.ctx.peer_id, step=-1, hop=0, route=route,
                                 needs_backward=False, tokens=self.pack_tokens(tokens))  # fmt: skip
        try:
            await self.send(peers[0], "rpc_forward", request, x)
            outcome = await asyncio.wait_for(asyncio.shield(done), self.ctx.config.limits.microbatch_timeout_s)
        except (HopFailed, TimeoutError) as e:
            logger.info("[%s] %s through %s did not come home: %s", self.ctx.short_id, tag,
                        [p[-8:] for p in peers], e)  # fmt: skip
            return None
        finally:
            self.in_flight.pop(wire_id, None)
        return entry.output if outcome.kind == "completed" else None

    @torch.no_grad()
    def top_predictions(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return to_host(self.head.logits(x, to_device(tokens, self.device)).argmax(-1))

    async def probe(self) -> dict | None:
        """--probe-file's probes through the swarm's model, after training (probes.py)."""
        path = self.ctx.config.output.probe_file
        return await run_probes(self, path) if path else None

    def stats(self) -> dict:
        return {
            "steps": len(self.history),
            "refused": self.refused,
            "averaging": self.averager.stats() if self.averager is not None else {"mode": self.run.averaging.mode},
            "stage0_gradients": self.gradients.stats() if self.gradients is not None else None,
            **self.ledger.summary(),
            **self.summary,
            **self.streams.stats(),
        }
