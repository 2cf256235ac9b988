"""A stage worker's `StepClose` handler: who may close a step (a data node our view lists, for a step
within the window step_window.py allows), a close sent again or overtaken, and what a close ends (the
state it keeps in step_clock.py)."""

from __future__ import annotations

import logging

from shoal.node.averaging.base import Averager
from shoal.node.hooks import Hooks
from shoal.node.pipeline.worker.admission import Admission
from shoal.node.pipeline.worker.kept import KeptState
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.stepper import Stepper
from shoal.node.pipeline.worker.waits import CloseWaits
from shoal.protocol.pipeline import Ack, StepClose

logger = logging.getLogger(__name__)


class StepCloses:
    """The `StepClose` handler: who may close a step, a close sent again or overtaken, and what a close
    ends: the graphs and gradients kept for its microbatches, the inner step it was due for, and every
    H steps of the data node's clock an outer epoch (NoLoCo: averaging with a replica)."""

    def __init__(
        self,
        clock: StepClock,
        admission: Admission,
        kept: KeptState,
        stepper: Stepper,
        waits: CloseWaits,
        averager: Averager | None,
        hooks: Hooks,
    ) -> None:
        self.clock, self.admission, self.kept, self.stepper = clock, admission, kept, stepper
        self.waits, self.averager, self.hooks = waits, averager, hooks

    async def on_step_close(self, close: StepClose, sender: str) -> Ack:
        """A data node's step is over. Step once every data node whose gradient we hold has closed the
        step that gradient belongs to (with one data node: exactly at its step boundary; a close that
        overtakes our own backward of its step counts when that backward is done). Every H steps of the
        data node's clock, average with a replica (NoLoCo) once our weights are final for the epoch.
        Only a data node our view lists keeps that clock, and only within the window of steps we can
        vouch for: anyone else could force outer steps at will, or push our inner step (and the record
        that publishes it) off the schedule. A refused close changes nothing."""
        clock = self.clock
        refusal = await self._refusal(close, sender)
        if refusal is not None:
            return Ack(accepted=False, reason=self.admission.refuse(sender, f"close of step {close.step}", refusal))
        if clock.sent_again(sender, close.step):
            return await self._close_again(close, sender)
        await clock.mark_heard(sender, close.step)
        try:
            await self.hooks.on_close(close.step, clock.short_id)
            if clock.overtaken(sender, close.step):
                logger.info("[%s] the close of step %d comes after that of step %d: stale, nothing to do",
                            clock.short_id, close.step, clock.handled[sender])  # fmt: skip
                return Ack(accepted=True)
            return await self._handle_close(close, sender)
        finally:
            await clock.mark_handled(sender, close.step)

    async def _refusal(self, close: StepClose, sender: str) -> str | None:
        """Why `sender` may not close `close.step`, if it may not. A close of a step we handled already
        is stale, and answered as such (`overtaken`); `completed` and `abandoned` are never read."""
        if await self.admission.listed_data_node(sender) is None:
            return "not a listed data node of this run"
        return await self.admission.step_refusal(close.step)

    async def _close_again(self, close: StepClose, sender: str) -> Ack:
        """A close we are still handling is answered once handled, not handled twice at once. Once
        handled, a close sent again is handled as any (it finds nothing left to step or average), which
        is also right for a data node that restarted and redid that step before our view noticed."""
        if not await self.clock.handled_in_time(sender, close.step):
            return Ack(accepted=False, reason=f"the close of step {close.step} is still being handled")
        return Ack(accepted=True)

    async def _handle_close(self, close: StepClose, sender: str) -> Ack:
        self.clock.closing(close.step)
        over = self.kept.close(sender, close.step)
        if over:
            logger.info("[%s] step %d closed: dropped %d graph(s) no gradient will reach", self.clock.short_id,
                        close.step, over)  # fmt: skip
        await self.waits.settle()  # our inner step, once no contributor that can still close is owed one
        epoch = self.averager.due(close.step) if self.averager is not None else None
        if epoch is not None and not await self.stepper.outer_step(self.averager, epoch):
            logger.info("[%s] outer epoch %d waits: an inner step is still pending", self.clock.short_id, epoch)
        return Ack(accepted=True)
