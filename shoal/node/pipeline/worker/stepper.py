"""When a stage worker's weights change: its inner step, once the step clock says it is due, and the
outer step of an epoch; never across a live forward graph.

AdamW updates the weights in place (and an outer step loads new ones in place), so a graph built
before an update and run backward after it fails. The stepper counts the graphs that live (built
by a forward and not yet run backward or dropped) and those being built, and holds a gate that new
graphs wait at while the weights change. A step that is due while graphs live waits for the last of
them: whoever frees one (a backward, a dropped graph, a failed forward) tries the step again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import torch

from shoal.node.averaging.base import Averager
from shoal.node.compute import BACKWARD
from shoal.node.engine import GradNorms
from shoal.node.pipeline.base import PipelineEngine
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.transcripts import TranscriptServer
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)


class Stepper:
    """Takes the inner step of `module` by `optimizer()` (a repair or a restore replaces the worker's
    optimizer) when `clock` says it is due and no graph lives; `hops` runs the compute jobs."""

    def __init__(
        self,
        hops: PipelineEngine,
        clock: StepClock,
        module: torch.nn.Module,
        optimizer: Callable[[], InnerOptimizer],
        transcripts: TranscriptServer,
        grad_norms: GradNorms,
    ) -> None:
        self.hops, self.clock, self.module, self.optimizer = hops, clock, module, optimizer
        self.transcripts, self.grad_norms = transcripts, grad_norms
        self.hooks = hops.ctx.hooks
        self.live_graphs = 0  # forward graphs (made on the compute thread) whose backward has not run
        self.graphs_starting = 0  # forwards past the step gate whose graph is not yet in live_graphs
        self.gate = asyncio.Event()  # cleared while an inner step is taken: no new graph meanwhile
        self.gate.set()
        self.weight_grads: list[asyncio.Future] = []  # W passes queued since the last inner step

    # ---- graphs -----------------------------------------------------------------------------------

    def graph_made(self) -> None:
        """A forward built a graph (on the compute thread)."""
        self.live_graphs += 1

    def graph_released(self) -> None:
        """A graph's backward ran, or a redo replaces it."""
        self.live_graphs -= 1

    def graph_dropped(self) -> None:
        """A graph no gradient will reach was forgotten: a pending step may then proceed."""
        self.live_graphs -= 1
        self.hops.spawn(self.maybe_step(), "deferred step")

    @contextlib.asynccontextmanager
    async def building_graph(self) -> AsyncIterator[None]:
        """Around a forward that keeps its graph, never across an inner step. A step waits for the
        graphs it would corrupt, those already counted and those on their way to the compute thread; a
        forward that comes while a step is taken (another data node's, whose clock is not ours) waits
        for it."""
        # A woken wait has not run yet when the step that set the gate hands over to an outer step, which
        # clears it again at once (the close that ended an inner step may end an outer epoch too): look
        # again before building a graph, or the outer step overwrites the weights under it.
        while not self.gate.is_set():
            await self.gate.wait()
        self.graphs_starting += 1
        try:
            yield
        finally:
            self.graphs_starting -= 1
            if self.graphs_starting == 0 and self.live_graphs == 0:  # a failed forward left no graph
                self.hops.spawn(self.maybe_step(), "deferred step")

    def weights_free(self) -> bool:
        """No forward graph lives or is being built, and no step is being taken: the weights may change."""
        return self.live_graphs == 0 and self.graphs_starting == 0 and self.gate.is_set()

    # ---- steps ------------------------------------------------------------------------------------

    def queue_weight_grads(self, priority: int, accumulate: Callable[[], None]) -> None:
        """A W pass, run on the compute thread when it has a free moment, and at the latest before the
        next inner step."""
        self.weight_grads.append(self.hops.compute_thread.run(priority, accumulate))

    async def maybe_step(self) -> None:
        """Step if due and no saved graph waits for its gradient: AdamW updates weights in place,
        which would corrupt the graphs of microbatches already forwarded with the old weights."""
        if not self.clock.step_due() or not self.weights_free():
            return
        self.clock.step_taken()
        compute = self.hops.compute
        self.gate.clear()
        try:
            pending, self.weight_grads = self.weight_grads, []
            await asyncio.gather(*pending)
            at = self.clock.closed_step
            await compute(self.transcripts.before_step, self.module, self.optimizer(), priority=BACKWARD)
            stats = await compute(self.optimizer().step, at, priority=BACKWARD)
            if self.hooks.alters_weights:
                params = list(self.module.parameters())
                await compute(self.hooks.after_step, params, at, priority=BACKWARD)
            lr_scale = self.optimizer().lr_scale
            await compute(self.transcripts.after_step, self.module, at, lr_scale, priority=BACKWARD)
        finally:
            self.gate.set()
        if stats.skipped:
            logger.warning("[%s] inner step %d skipped: gradient norm %s", self.hops.ctx.short_id, stats.step,
                           stats.grad_norm)  # fmt: skip
            return
        self.grad_norms.note(stats.grad_norm, self.hops.run.optim.grad_clip)

    async def outer_step(self, averager: Averager, epoch: int) -> bool:
        """Take outer epoch `epoch`'s step unless an inner step is pending or the weights are in use;
        returns whether it was taken."""
        if not self.weights_free() or self.clock.contributors:
            return False
        self.gate.clear()  # the outer step loads new weights in place, as an inner step
        try:
            await averager.outer_step(epoch)
        finally:
            self.gate.set()
        return True
