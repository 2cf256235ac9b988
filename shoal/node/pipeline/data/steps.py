"""A data node's step loop: sample its shard's batch for step t, inject its microbatches, wait for them
to end (never for the whole swarm), close the step with the workers, and step stage 0; evaluate when
the run says so, and once more (with the probes) after the last step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from shoal.node.context import NodeContext
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.data.answers import MicrobatchAnswers
from shoal.node.pipeline.data.attempts import Attempts
from shoal.node.pipeline.data.auditor import Auditor
from shoal.node.pipeline.data.captures import Captures
from shoal.node.pipeline.data.closes import StepCloses
from shoal.node.pipeline.data.exclusions import Exclusions
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.node.pipeline.data.probes import run_probes
from shoal.node.pipeline.data.progress import ProgressFile, StageWatch
from shoal.node.pipeline.data.routes import DataRoutes
from shoal.node.pipeline.data.step_audits import StepAuditor
from shoal.planning.swarm_view import SwarmView
from shoal.train.data import BatchSampler, TokenSplits, load_token_splits, validation_batches
from shoal.train.inner import StepStats

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    step: int
    loss: float | None
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)


class StepLoop:
    """`hops`: the engine's hop layer (its compute thread, its background tasks); `step_stage0`: stage
    0's own step of a training step (gradient exchange, inner and outer step), given its step."""

    def __init__(
        self,
        ctx: NodeContext,
        hops: PipelineEngine,
        *,
        shard: int,
        num_shards: int,
        attempts: Attempts,
        answers: MicrobatchAnswers,
        closes: StepCloses,
        routes: DataRoutes,
        ledger: MicrobatchLedger,
        progress: ProgressFile,
        auditor: Auditor,
        step_audits: StepAuditor,
        exclusions: Exclusions,
        captures: Captures,
        step_stage0: Callable[[int], Awaitable[StepStats]],
    ):
        self.ctx, self.run, self.hops = ctx, ctx.run, hops
        self.shard, self.num_shards = shard, num_shards
        self.attempts, self.answers, self.closes = attempts, answers, closes
        self.routes, self.ledger, self.progress = routes, ledger, progress
        self.auditor, self.step_audits, self.exclusions, self.captures = auditor, step_audits, exclusions, captures
        self.step_stage0 = step_stage0
        self.stage_watch = StageWatch(ctx, progress, ledger)
        self.splits: TokenSplits | None = None
        self.sampler: BatchSampler | None = None
        self.history: list[StepResult] = []
        self.finished = asyncio.Event()
        self.summary: dict = {}
        self.loss: float | None = None  # the last step's training loss
        self.current_step = 0
        self.first_step = 0  # resumed from --state-dir: the steps before it are done (state_keeper.py)

    async def load_data(self) -> None:
        """Load and tokenize this node's data (on the compute thread)."""
        run = self.run
        tokenizer = self.ctx.checkpoint.tokenizer_file if self.ctx.checkpoint is not None else None
        self.splits = await self.hops.compute(load_token_splits, run.data, run.model.vocab_size, tokenizer)
        self.sampler = BatchSampler(
            self.splits.train, run.train.seq_len, run.train.batch_size, run.train.seed, self.shard, self.num_shards
        )

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

    async def train(self) -> dict:
        """Train the run's steps from `first_step`; returns the summary (also the progress file's last line)."""
        assert self.sampler is not None, "load_data() first"
        await self.wait_for_pipeline()
        started = time.monotonic()
        self.progress.write({"event": "start", "peer_id": self.ctx.peer_id, "run_id": self.run.run_id})
        self.hops.spawn(self.stage_watch.run(self.finished, lambda: self.current_step), "watch stages")
        for step in range(self.first_step, self.run.train.steps):
            self.current_step = step
            result = await self.train_step(step)
            self.history.append(result)
            self.loss = result.loss
            validation = {}
            if self.run.train.evaluates_after(step):
                await self.closes.taken()  # every worker evaluates on this step's weights
                validation = {"val_loss": await self.evaluate(f"s{step}")}
            self.progress.write(
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
        await self.closes.taken()  # evaluation and probes see every worker's last step
        self.exclusions.on_view(await self.ctx.refresh_view())  # exclusions workers just published count too
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
        self.progress.write({"event": "done", **self.summary})
        self.finished.set()
        return self.summary

    async def train_step(self, step: int) -> StepResult:
        assert self.sampler is not None
        started = time.monotonic()
        inputs, targets = self.sampler.batch(step)
        n_micro = self.run.microbatches_per_step
        slots = asyncio.Semaphore(self.ctx.max_inflight)
        self.attempts.begin_step()
        self.step_audits.begin()
        await self.routes.begin_step(step)
        if self.routes.swarm_changed:  # what SkipPipe planned over, for the simulator to replay (benchmarks)
            self.progress.write({"event": "planned_over", "step": step, "timetable": self.run.skippipe.timetable,
                                 "swarm": asdict(self.routes.planned_over)})  # fmt: skip
        pieces = zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True)
        jobs = [
            asyncio.create_task(self.attempts.microbatch(f"{step}.{i}", step, x, y, 1.0 / n_micro, slots, index=i))
            for i, (x, y) in enumerate(pieces)
        ]
        audit = self.auditor.maybe_audit(step, inputs[: self.run.train.microbatch_size])  # beside the step's work
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        if audit is not None:
            await audit
        await self.answers.weight_grads_done()
        await self.closes.taken()  # the last step's: one close in flight at a time
        closing = self.closes.close(step, len(losses), n_micro - len(losses), self.attempts.step_peers)
        self.step_audits.finish(step, closing)
        stats = await self.step_stage0(step)  # while the workers take theirs
        if self.closes.workers_average_after(step):  # the next step starts on the block stages' outer step
            await self.closes.taken()
        tokens_per_microbatch = inputs.numel() // n_micro
        return StepResult(
            step=step,
            loss=sum(losses) / len(losses) if losses else None,
            tokens=len(losses) * tokens_per_microbatch,
            seconds=time.monotonic() - started,
            extra={
                "lr": stats.lr,
                "audits": self.auditor.audits,
                "excluded": len(self.exclusions.excluded),
                **(
                    {"plan": self.routes.plan_digest, "full_pass": self.routes.full_pass}
                    if self.routes.skippipe
                    else {}
                ),
            },
        )

    async def evaluate(self, tag: str = "end") -> float | None:
        """Validation loss of the whole swarm model, forward only, over the shared validation batches
        (None if none came home). `tag` keeps each evaluation's microbatch ids apart."""
        assert self.splits is not None, "load_data() first"
        t = self.run.train
        slots = asyncio.Semaphore(self.ctx.max_inflight)
        jobs = []
        for b, (x, y) in enumerate(validation_batches(self.splits.val, t.seq_len, t.batch_size, t.eval_batches)):
            for i, (xm, ym) in enumerate(
                zip(x.chunk(self.run.microbatches_per_step), y.chunk(self.run.microbatches_per_step), strict=True)
            ):
                jobs.append(self.attempts.microbatch(f"{tag}.{b}.{i}", -1, xm, ym, 1.0, slots, train=False))
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        return sum(losses) / len(losses) if losses else None

    async def probe(self) -> dict | None:
        """--probe-file's probes through the swarm's model, after training (probes.py)."""
        path = self.ctx.config.output.probe_file
        return await run_probes(path, self.ctx, self.routes, self.captures) if path else None
