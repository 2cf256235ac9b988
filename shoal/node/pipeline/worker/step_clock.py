"""The step clock of a stage worker: the data nodes' step closes (`StepClose`) and who contributed to
the inner step that they end.

A worker steps when the data nodes it served say their step is closed, never by counting
microbatches: per data node it keeps the latest step whose close arrived (heard) and was handled,
and the latest of its steps whose gradient accumulated here since our last inner step (the
contributors). The inner step is due once every contributor has closed the step its gradient belongs
to. A data node sends a step's forwards without waiting for its close of the step before to be
answered, so a forward may overtake that close: it waits here for it. This module is the one place
where contributors are counted and an inner step is found due; the `StepClose` handler that feeds
it is closes.py, and the rule for a contributor whose close never comes is waits.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.protocol.pipeline import ForwardRequest

logger = logging.getLogger(__name__)

# A forward that overtook its data node's close of the step before waits this long for the close to
# arrive (see `StepClock.after_previous_close`). A close that does not come by then was lost, and the
# forward goes ahead.
CLOSE_OVERTAKEN_WAIT_S = 5.0


class StepClock:
    """Per data node: the closes heard and handled, and the steps whose gradients await our inner step.

    `patience_s` is how long handling a close may take (hops.py `step_close_patience_s`): a data node
    waits that long for our answer, and so long we hold its next step's forwards."""

    def __init__(self, patience_s: float, short_id: str) -> None:
        self.patience_s = patience_s
        self.short_id = short_id
        self.heard: dict[str, int] = {}  # per data node: the latest step whose close arrived
        self.handled: dict[str, int] = {}  # ... and was handled: stepped, and averaged when due
        # data node -> the latest of its steps whose gradient has accumulated here since our last step
        self.contributors: dict[str, int] = {}
        self.awaited_since: dict[str, float] = {}  # contributor -> since when we wait for its close
        self.closed_step = -1  # the latest data-node step closed here (the backdoor's injection clock)
        self._news = asyncio.Condition()

    # ---- contributors -----------------------------------------------------------------------------

    def contributed(self, origin: str, step: int) -> None:
        """A gradient of data node `origin`'s step `step` accumulated here."""
        if origin not in self.awaited():
            self.awaited_since[origin] = time.monotonic()
        self.contributors[origin] = max(self.contributors.get(origin, -1), step)

    def awaited(self) -> dict[str, int]:
        """The contributors whose close of the step their gradient belongs to has not come yet."""
        return {d: s for d, s in self.contributors.items() if self.heard.get(d, -1) < s}

    def step_due(self) -> bool:
        """Some gradient accumulated since our last inner step, and every data node it came from has
        closed the step it belongs to."""
        return bool(self.contributors) and not self.awaited()

    def release(self, origin: str, why: str) -> None:
        """Wait no more for `origin`'s close (waits.py says when): what it contributed stays in the
        gradient and goes into the inner step taken without it."""
        step = self.contributors.pop(origin, None)
        self.awaited_since.pop(origin, None)
        if step is not None:
            logger.warning("[%s] no longer waiting for %s to close step %d: %s", self.short_id, origin[-8:], step,
                           why)  # fmt: skip

    def step_taken(self) -> None:
        """The inner step begins: what accumulated so far is in it, and waits for no close any more."""
        self.contributors = {}
        self.awaited_since = {}

    # ---- closes -----------------------------------------------------------------------------------

    def sent_again(self, origin: str, step: int) -> bool:
        """A close sent again while we handle it (its kept stream failed after we heard it)."""
        return self.handled.get(origin, -1) < step == self.heard.get(origin, -1)

    def overtaken(self, origin: str, step: int) -> bool:
        """A close that comes after a later one of the same data node was handled (the hold of that
        later step's forwards gave up on it): nothing is left for it to do."""
        return step < self.handled.get(origin, -1)

    async def mark_heard(self, origin: str, step: int) -> None:
        """`origin`'s close of `step` arrived: forwards held for it may look whether it was handled."""
        await self._record(self.heard, origin, step)

    async def mark_handled(self, origin: str, step: int) -> None:
        """`origin`'s close of `step` was handled (or found stale): forwards held for it go ahead."""
        await self._record(self.handled, origin, step)

    def closing(self, step: int) -> None:
        """A close is being handled, past the checks above: the latest closed step moves."""
        self.closed_step = max(self.closed_step, step)

    async def _record(self, record: dict[str, int], origin: str, step: int) -> None:
        async with self._news:
            record[origin] = max(record.get(origin, -1), step)
            self._news.notify_all()

    async def handled_in_time(self, origin: str, step: int) -> bool:
        """Whether `origin`'s close of `step` is handled within our patience."""
        async with self._news:
            return await self._handled_in_time(origin, step)

    async def _handled_in_time(self, origin: str, step: int) -> bool:
        try:
            await asyncio.wait_for(self._news.wait_for(lambda: self.handled.get(origin, -1) >= step), self.patience_s)
        except TimeoutError:
            return False
        return True

    async def after_previous_close(self, request: ForwardRequest) -> None:
        """A training forward of step s must run on the weights that its data node's step s-1 left
        here. That step's close is sent before the forward but on another stream, and the data node
        does not wait for our answer, so the forward may come first: hold it until the close has
        arrived and been handled. Only a data node we served before is owed a step; a close that does
        not arrive within CLOSE_OVERTAKEN_WAIT_S was lost, and the forward runs on the weights we have.
        Handling an arrived close is waited for as long as its data node waits for our answer: past that,
        it has given up on us (an outer step stuck in an all-reduce, say), and so do we."""
        origin, previous = request.origin, request.step - 1
        if not request.needs_backward or previous < 0 or self.handled.get(origin, -1) >= previous:
            return
        if origin not in self.heard and origin not in self.contributors:
            return
        async with self._news:
            try:
                await asyncio.wait_for(
                    self._news.wait_for(lambda: self.heard.get(origin, -1) >= previous), CLOSE_OVERTAKEN_WAIT_S
                )
            except TimeoutError:
                logger.info("[%s] %s: no close of step %d came from its data node; forwarding on the weights we "
                            "have", self.short_id, request.microbatch_id, previous)  # fmt: skip
                return
            if not await self._handled_in_time(origin, previous):
                logger.warning("[%s] %s: the close of step %d is still being handled after %.0f s; forwarding "
                               "on the weights we have", self.short_id, request.microbatch_id, previous,
                               self.patience_s)  # fmt: skip

    def forget(self, origin: str) -> None:
        """A data node restarted under the same peer id: its new process counts anew."""
        for clock in (self.heard, self.handled, self.contributors, self.awaited_since):
            clock.pop(origin, None)
