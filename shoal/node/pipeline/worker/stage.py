"""A stage worker: the engine of a node that holds one block stage. It serves the data nodes'
microbatches (forward, backward, and the redo of a lost hop), steps its inner optimizer when they
close their steps, and averages with the other replicas of its stage.

The worker is a coordinator: each protocol and the state whose invariant it keeps lives in its own
module, built here and handed only what it uses.

- admission.py: who may send what (route, sender and data-node checks; refusals);
- kept.py: what is kept per microbatch (graphs, sent gradients, done marks) and until when;
- forward.py: forwards taken, bounded by the node's in-flight memory, computed and passed on;
- backward.py: the B/W-split backward and the gradient passed upstream;
- redo.py: recompute, recover and resume of a lost hop;
- step_clock.py: the data nodes' step closes and the contributors to our inner step;
- step_window.py: which of a data node's steps a peer may name;
- waits.py: how long the inner step waits for a contributor's close;
- stepper.py: the inner and outer steps, never across a live forward graph;
- notices.py: what a worker tells a data node unasked; transcripts.py: the step audit's records.

Everything a request names is keyed by microbatch id, and a repeated request is taken as done:
a sender that retries a broken stream never makes a hop run twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping

from shoal.device import compute_kind
from shoal.model.hf import initial_stage
from shoal.node.averaging.base import Averager, exchange_timeout_s
from shoal.node.averaging.modes import AVERAGERS
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.node.engine import GradNorms, Handler, Progress, Repair, TrainedState, outer_state_of, restore_trained
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.hops import WIRE_MAX_ABS, step_close_patience_s
from shoal.node.pipeline.worker.admission import Admission
from shoal.node.pipeline.worker.backward import Backwarder
from shoal.node.pipeline.worker.closes import StepCloses
from shoal.node.pipeline.worker.forward import Forwarder
from shoal.node.pipeline.worker.kept import KeptState
from shoal.node.pipeline.worker.redo import Redo
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.step_window import StepWindow
from shoal.node.pipeline.worker.stepper import Stepper
from shoal.node.pipeline.worker.transcripts import TranscriptServer
from shoal.node.pipeline.worker.waits import CloseWaits, close_wait_s
from shoal.node.rpcs import EngineRpcs
from shoal.node.stage.backups import BackupKeeper, BackupSource
from shoal.node.stage.copy import join_stage, serve_stage_copy
from shoal.node.stage.kept_copies import StageCopyKeeper
from shoal.node.stage.repair import repair_stage, stage_was_lost
from shoal.p2p.rpc import Rpc
from shoal.p2p.streams import FramedStream
from shoal.planning.backups import backed_up_stage, backup_keepers, keeps_edge_copy
from shoal.protocol.pipeline import Ack, BackupPull, StageCopyRequest, StepTranscriptRequest
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)


class StageWorker(PipelineEngine):
    def __init__(self, ctx: NodeContext, stage: int):
        super().__init__(ctx)
        run = self.run
        self.stage = stage
        module = initial_stage(run.model, run.pipeline.stages, stage, run.train.seed, ctx.checkpoint)
        self.module = module.to(ctx.device)
        self.optimizer = InnerOptimizer(self.module, run.optim, run.train.steps)
        self.copies_served = 0
        self.hooks = ctx.hooks  # fault injection and an EXPERIMENT's hostile behaviour (hooks.py)
        self.grad_norms = GradNorms()
        self.repair: Repair | None = None  # how this node rebuilt its stage, if it did (CheckFree)
        self.failed_donors: frozenset[str] = frozenset()  # listed replicas that did not give their weights
        averager_type = AVERAGERS.get(run.averaging.mode)  # None: replicas never share weights
        self.averager: Averager | None = averager_type(ctx, self) if averager_type is not None else None
        # stage 0's copy under CheckFree+, where we neighbour it (kept_copies.py); our own stage's chain of
        # backup snapshots, and the backup of the block stage before ours (backups.py)
        self.edge_copy: StageCopyKeeper | None = None
        if keeps_edge_copy(run.repair.rule, run.pipeline.stages, stage):
            self.edge_copy = StageCopyKeeper(self, 0, run.repair.edge_copy_every, "CheckFree+")
        backups, backed_up = run.repair.backup_every > 0, backed_up_stage(run.pipeline.stages, stage)
        keepers = backup_keepers(run.pipeline.stages, stage)
        self.backup_source = BackupSource(self, run.repair.backup_every) if backups and keepers else None
        self.backup_keeper = BackupKeeper(self, backed_up) if backups and backed_up is not None else None
        # for data nodes' step audits
        self.transcripts = TranscriptServer(
            run.defense.step_audit_rate > 0, compute_kind(ctx.device, ctx.compute_dtype)
        )
        # The protocols, each handed the state it keeps or reads; `self` is passed as the PipelineEngine
        # they send and compute through.
        self.clock = StepClock(step_close_patience_s(exchange_timeout_s(run)), ctx.short_id)
        self.stepper = Stepper(self, self.clock, self.module, lambda: self.optimizer, self.transcripts, self.grad_norms)
        self.kept = KeptState(ctx.config.limits, self.stepper.graph_dropped)
        window = StepWindow(ctx, self.clock, lambda: self.optimizer.step_count)
        self.admission = Admission(self, stage, self.kept, window)
        wait_s = close_wait_s(ctx.config.limits, exchange_timeout_s(run))
        self.waits = CloseWaits(self.clock, self.admission, self.kept, self.stepper, wait_s)
        self.forwarder = Forwarder(self, stage, self.module, self.admission, self.clock, self.stepper, self.kept)
        self.backwarder = Backwarder(
            self, self.module, self.admission, self.kept, self.clock, self.stepper, self.transcripts
        )
        self.redo = Redo(self, stage, self.admission, self.kept, self.stepper, self.forwarder, self.backwarder)
        self.closes = StepCloses(
            self.clock, self.admission, self.kept, self.stepper, self.waits, self.averager, self.hooks
        )

    @property
    def busy(self) -> bool:
        return bool(self.kept.saved) or bool(self.forwarder.forwarding)

    @property
    def movable(self) -> bool:
        """Untrained and idle: this node may still change stage without losing anything."""
        return not self.busy and self.forwarder.forwards == 0

    def handlers(self) -> Mapping[Rpc, Handler]:
        return {
            EngineRpcs.forward: self.forwarder.on_forward,
            EngineRpcs.backward: self.backwarder.on_backward,
            EngineRpcs.recompute: self.redo.on_recompute,
            EngineRpcs.fetch_output: self.redo.on_fetch_output,
            EngineRpcs.redo_output: self.redo.on_redo_output,
            EngineRpcs.abandon: self.kept.on_abandon,
            EngineRpcs.recover: self.redo.on_recover,
            EngineRpcs.resume_forward: self.redo.on_resume_forward,
            EngineRpcs.step_close: self.closes.on_step_close,
            EngineRpcs.gossip: self.on_gossip,
            EngineRpcs.copy_stage: self.on_copy_stage,
            EngineRpcs.backup_pull: self.on_backup_pull,
            EngineRpcs.step_transcript: self.on_step_transcript,
        }

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
            self.spawn(self.edge_copy.run(), "copy of stage 0")
        if self.backup_source is not None:
            self.spawn(self.backup_source.run(), f"backup snapshots of stage {self.stage}")
        if self.backup_keeper is not None:
            self.spawn(self.backup_keeper.run(), f"backup of stage {self.backup_keeper.stage}")

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
            backup=self.backup_source.note() if self.backup_source is not None else None,
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
        if await self.admission.listed_data_node(sender) is None:
            reason = self.admission.refuse(sender, request.microbatch_id, "not a listed data node of this run")
            await stream.write_message(Ack(accepted=False, reason=reason))
            return
        await self.transcripts.serve(request, stream)

    async def on_copy_stage(self, request: StageCopyRequest, stream: FramedStream, sender: str) -> None:
        if request.stage == 0 and self.edge_copy is not None:
            await self.edge_copy.serve(stream)  # a data node restoring stage 0 from our copy
            return
        await serve_stage_copy(self, request, stream)
        self.copies_served += 1

    async def on_backup_pull(self, request: BackupPull, stream: FramedStream, sender: str) -> None:
        """Our stage's latest snapshot (to its keepers), or the one we keep of the stage before ours (to a
        node restoring it, or a joiner of our stage taking our backup over)."""
        if request.stage == self.stage and self.backup_source is not None:
            await self.backup_source.serve(request, stream)
        elif self.backup_keeper is not None and request.stage == self.backup_keeper.stage:
            await self.backup_keeper.serve(stream)
        else:
            await stream.write_message(Ack(accepted=False, reason=f"no backup of stage {request.stage} here"))

    async def join_by_copy(self) -> str | None:
        """Before serving a stage that has a live replica, take its weights; returns whom we copied.
        A listed donor may be dead (its record outlives it) or busy serving another joiner: each is
        skipped, and asked again or waited for (copy.py `join_stage`); the ones that failed are kept in
        `failed_donors`, so that a stage none of whose listed replicas answered is repaired, not started
        fresh."""
        attempt = await join_stage(self)
        self.failed_donors = frozenset(attempt.failed)
        if attempt.source is not None:
            # the donor's copies of neighbouring stages come along
            if self.edge_copy is not None:
                await self.edge_copy.take_from(attempt.source)
            if self.backup_keeper is not None:
                await self.backup_keeper.take_from(attempt.source)
        return attempt.source

    async def work(self) -> dict | None:
        """A stage worker drives nothing: it serves the data nodes' microbatches until stopped."""
        return None

    def on_view(self, view) -> None:
        """A fresh view of the swarm (each heartbeat, and whenever a peer becomes suspect or leaves):
        forget what has expired, and stop waiting for the closes of contributors that cannot send them."""
        self.kept.expire()
        self.spawn(self.waits.settle(), "settle the step's waits")

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """Restarted data nodes: none of what their old processes injected will come back."""
        super().on_peer_restarted(restarted, live)
        for peer in restarted:
            self.kept.forget_origin(peer)
            self.clock.forget(peer)

    def stats(self) -> dict:
        return {
            "forwards": self.forwarder.forwards,
            "backwards": self.backwarder.backwards,
            "inner_steps": self.optimizer.step_count,
            "in_flight": len(self.kept.saved),
            "gradients_kept": len(self.kept.sent),
            "expired": self.kept.expired,
            "refused": self.admission.refused,
            "steps_skipped": self.optimizer.skipped,
            "recomputed": self.redo.recomputed,
            "recompute_s": round(self.redo.recompute_s, 3),
            "collisions": self.compute_thread.collisions,
            "collision_s": round(self.compute_thread.collision_s, 4),
            "forwards_resumed": self.redo.resumed,
            "recomputes_delegated": self.recomputes_delegated,
            "outputs_redone": self.redo.outputs_redone,  # for the hop after ours, its input lost
            "outputs_redone_asked": self.outputs_redone,  # asked of replicas upstream
            "stream_retries": self.stream_retries,
            **self.streams.stats(),
            "copies_served": self.copies_served,
            "transcripts_served": self.transcripts.served,
            "adversary": self.hooks.stage_attack_name,
            "averaging": self.averager.stats() if self.averager is not None else {"mode": self.run.averaging.mode},
            "edge_copy": self.edge_copy.stats() if self.edge_copy is not None else None,
            "backup": self.backup_keeper.stats() if self.backup_keeper is not None else None,
            "backup_source": self.backup_source.stats() if self.backup_source is not None else None,
        }
