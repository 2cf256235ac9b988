"""A data node: samples its shard, embeds, routes microbatches through the swarm, computes the
loss when an activation comes home, sends the gradient back, and steps the embedding and head.

`DataDriver` is the engine the node runs (engine.py): it holds stage 0 (embedding and LM head, its
optimizer and averager) and builds the parts that each own one protocol: the step loop (steps.py), a
microbatch's attempts (attempts.py), the answers to its hops (answers.py), the recovery of those that
lost a peer (recovery.py), the step close (closes.py), and the audits (auditor.py, step_audits.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from shoal.errors import UsageError
from shoal.model.hf import initial_stage
from shoal.node.averaging.base import Averager
from shoal.node.averaging.modes import AVERAGERS
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.node.engine import GradNorms, Handler, Progress, TrainedState, outer_state_of, restore_trained
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.data.answers import MicrobatchAnswers
from shoal.node.pipeline.data.attempts import Attempts
from shoal.node.pipeline.data.auditor import Auditor
from shoal.node.pipeline.data.captures import Captures
from shoal.node.pipeline.data.closes import StepCloses
from shoal.node.pipeline.data.exclusions import Exclusions
from shoal.node.pipeline.data.gradients import GradientExchange
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.node.pipeline.data.progress import ProgressFile
from shoal.node.pipeline.data.recovery import Recovery
from shoal.node.pipeline.data.routes import DataRoutes
from shoal.node.pipeline.data.step_audits import StepAuditor
from shoal.node.pipeline.data.steps import StepLoop
from shoal.node.rpcs import EngineRpcs
from shoal.node.stage.copy import join_stage, serve_stage_copy
from shoal.node.stage.kept_copies import recover_stage0
from shoal.p2p.rpc import Rpc
from shoal.p2p.streams import FramedStream
from shoal.planning.observed import Trip
from shoal.planning.swarm_view import SwarmView
from shoal.protocol.pipeline import Ack, GradientShare, StageCopyRequest
from shoal.train.inner import InnerOptimizer, StepStats

logger = logging.getLogger(__name__)


class DataDriver(PipelineEngine):
    """The parts below get the hop layer they send through (`self`, as a PipelineEngine) and the
    narrow state they share, never the driver: each owns its protocol's state."""

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
        self.grad_norms = GradNorms()
        self.ledger = MicrobatchLedger()
        self.progress_file = ProgressFile(progress_path)
        self.exclusions = Exclusions(ctx, self.progress_file, lambda: self.steps.current_step)
        self.routes = DataRoutes(ctx, self.banned, self.exclusions.peers)
        self.step_audits = StepAuditor(ctx, self.compute, self.spawn, self.exclusions)  # replays of an inner step
        self.attempts = Attempts(
            ctx, self, self.head, self.routes, self.ledger, self.exclusions.peers, self.step_audits.note_completed
        )
        self.recovery = Recovery(ctx, self, self.attempts, self.ledger, self.banned)
        self.answers = MicrobatchAnswers(
            ctx, self, self.head, self.attempts, self.recovery, self.step_audits.note_output
        )
        self.closes = StepCloses(ctx, self.rpc, self.spawn)
        self.captures = Captures(ctx, self, self.head, self.attempts.in_flight)
        self.auditor = Auditor(ctx, self.captures, self.exclusions, self.banned, self.closes.taken)
        self.steps = StepLoop(
            ctx,
            self,
            shard=shard,
            num_shards=num_shards,
            attempts=self.attempts,
            answers=self.answers,
            closes=self.closes,
            routes=self.routes,
            ledger=self.ledger,
            progress=self.progress_file,
            auditor=self.auditor,
            step_audits=self.step_audits,
            exclusions=self.exclusions,
            captures=self.captures,
            step_stage0=self.step_stage0,
        )

    movable = False  # a data node keeps its shard, embedding and head
    stage = 0

    @property
    def module(self) -> torch.nn.Module:
        return self.head

    @property
    def busy(self) -> bool:
        return bool(self.attempts.in_flight)

    async def start(self) -> None:
        """Load and tokenize this node's data (on the compute thread): training starts with `work`."""
        await self.steps.load_data()
        if self.averager is not None:
            await self.averager.start()

    async def work(self) -> dict | None:
        return await self.steps.train()

    async def step_stage0(self, step: int) -> StepStats:
        """Stage 0's share of training step `step`, while the workers take theirs: the mean of its
        gradients with another data node's, the inner step, and (every step, by default) the outer step
        with the other data nodes."""
        if self.gradients is not None:
            await self.gradients.exchange(step)
        stats = await self.compute(self.optimizer.step, step)
        epoch = self.averager.due(step) if self.averager is not None else None
        if epoch is not None:
            await self.averager.outer_step(epoch)
        if stats.skipped:
            logger.warning("[%s] step %d skipped: gradient norm %s", self.ctx.short_id, step, stats.grad_norm)
        else:
            self.grad_norms.note(stats.grad_norm, self.run.optim.grad_clip)
        return stats

    def banned(self) -> set[str]:
        """Peers that just failed us, and replicas our audits excluded for good."""
        return super().banned() | self.exclusions.peers()

    # ---- what the node asks of its engine (engine.py) ------------------------------------------------

    def handlers(self) -> Mapping[Rpc, Handler]:
        answers = self.answers
        return {
            EngineRpcs.forward: answers.on_forward,
            EngineRpcs.backward: answers.on_backward,
            EngineRpcs.fetch_output: answers.on_fetch_output,
            EngineRpcs.abandon: answers.on_abandon,
            EngineRpcs.route_note: answers.on_route_note,
            EngineRpcs.copy_stage: self.on_copy_stage,
            EngineRpcs.gossip: self.on_gossip,
            EngineRpcs.gradient_share: self.on_gradient_share,
        }

    async def on_gradient_share(self, request: GradientShare, stream: FramedStream, sender: str) -> Ack | None:
        if self.gradients is None:
            return Ack(accepted=False, reason="this data node does not average stage-0 gradients")
        return await self.gradients.on_share(request, stream, sender)

    async def on_copy_stage(self, request: StageCopyRequest, stream: FramedStream, sender: str) -> None:
        """Stage 0's weights, for `shoal export` (a data node's embedding and head are copied by no node)."""
        await serve_stage_copy(self, request, stream)

    def on_view(self, view: SwarmView) -> None:
        """A fresh view of the swarm (each heartbeat): act on microbatches that lost a peer."""
        self.recovery.reap_lost({n.peer_id for n in view.live_nodes()})
        self.exclusions.on_view(view)

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """What went through restarted peers' old processes is lost with them, as if they had left."""
        super().on_peer_restarted(restarted, live)
        self.recovery.reap_lost(live - restarted)

    def progress(self) -> Progress:
        averager = self.averager
        return Progress(
            inner_step=self.optimizer.step_count,
            outer_epoch=averager.epoch if averager is not None else 0,
            replica_distance=averager.last_distance if averager is not None else None,
            averager_maddrs=tuple(averager.maddrs) if averager is not None else (),
            loss=self.steps.loss,
            grad_norm=self.grad_norms.raw,
            grad_norm_clipped=self.grad_norms.clipped,
            waiting_for=tuple(self.steps.stage_watch.waiting_for),
            excluded=tuple(self.exclusions.record()),
        )

    def trips(self) -> Sequence[Trip]:
        return list(self.answers.recent_trips)

    async def load_state_dict(self, state: TrainedState) -> None:
        """Go on from a save: its weights and optimizer, and its step (a step's batch is a pure function
        of run, shard and step, so the step is this node's position in its data)."""
        self.optimizer = await self.compute(restore_trained, self.head, state, self.run, priority=BACKWARD)
        if self.averager is not None:
            self.averager.load(outer_state_of(state, self.head), state.outer_epoch)
        self.steps.first_step = state.inner_step

    async def join_by_copy(self) -> str | None:
        """Where the run averages stage 0, a data node joining a run that has stepped copies it from
        the most trained live data node, and goes on from that node's step (NoLoCo pairs replicas of
        the same outer epoch, and epochs follow steps); its batches are still its own shard's. Where no
        data node gave it and the run repairs with CheckFree+, it takes the copy stage 0's neighbours
        keep (kept_copies.py)."""
        source = None
        if self.averager is not None:
            source = (await join_stage(self)).source
        if source is None:
            source = await recover_stage0(self)
        if source is not None:
            self.steps.first_step = self.optimizer.step_count
        return source

    def stats(self) -> dict:
        return {
            "steps": len(self.steps.history),
            "refused": self.answers.refused,
            "averaging": self.averager.stats() if self.averager is not None else {"mode": self.run.averaging.mode},
            "stage0_gradients": self.gradients.stats() if self.gradients is not None else None,
            **self.ledger.summary(),
            **self.steps.summary,
            **self.streams.stats(),
        }
