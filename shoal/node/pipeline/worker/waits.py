"""How long a stage worker waits for a contributor's step close: while it is alive, and within a bound.

The inner step waits for every data node whose gradient accumulated here to close the step that
gradient belongs to (step_clock.py). A contributor that cannot close it must not hold the step for
everyone: a stranger that is no data node of the run (its close would be refused), a data node
that died mid-step or that we suspect, or one whose close is overdue. Such a contributor is released
from the wait with a logged reason. What it contributed is kept, and goes into the inner step taken
without it: it came from microbatches checked hop by hop like any other, it is clipped with the rest,
and it is already summed into the gradient (nothing could take it out again).

A contributor is released when:
- our view, read afresh after its first gradient of the step (at most twice a second), lists it as
  no live data node of the run: a stranger, a data node gone, or one we suspect (the view leaves
  suspects out);
- its close is `wait_s` late, counted from that first gradient: by then its data node has given up
  every microbatch of the step (their timeout, plus the wait for a stage without a replica, which is
  also how long we keep their graphs), and handling its close would have taken the close patience;
- another data node has closed a step CLOSE_LAG_STEPS past it: data nodes of one run step together
  (one batch per step each), so one that far behind is not coming soon.

A step that is due may also be held by forward graphs whose backward will never come: those of an
origin no view lists (a stranger that never sends the backward, a data node killed mid-step) are
then dropped too. Other graphs expire on their own (kept.py).

`settle` applies the rule and tries the inner step; it runs after every step close and on every view
the node takes (each heartbeat, and at once when a peer becomes suspect or leaves).
"""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.node.config import LimitOptions
from shoal.node.pipeline.hops import step_close_patience_s
from shoal.node.pipeline.worker.admission import Admission
from shoal.node.pipeline.worker.kept import KeptState
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.stepper import Stepper

logger = logging.getLogger(__name__)

CLOSE_LAG_STEPS = 3


def close_wait_s(limits: LimitOptions, exchange_timeout_s: float) -> float:
    """How long a contributor's close is waited for (see the module docstring)."""
    return limits.microbatch_timeout_s + limits.stage_wait_s + step_close_patience_s(exchange_timeout_s)


class CloseWaits:
    """The waits of a worker's inner step on `clock`'s contributors, and on `kept`'s graphs."""

    def __init__(self, clock: StepClock, admission: Admission, kept: KeptState, stepper: Stepper, wait_s: float):
        self.clock, self.admission, self.kept, self.stepper = clock, admission, kept, stepper
        self.wait_s = wait_s
        self._settling = asyncio.Lock()

    async def settle(self) -> None:
        """Release the contributors we should not wait for, and the graphs of origins that are no data
        node of the run where they hold a due step; then take the inner step if it is due."""
        async with self._settling:  # one look at a time: each may read the view afresh
            await self._release_contributors()
            if self.clock.step_due() and not self.stepper.weights_free():
                await self._drop_unlisted_graphs()
        await self.stepper.maybe_step()

    async def _release_contributors(self) -> None:
        clock = self.clock
        for origin in sorted(clock.awaited()):
            if await self.admission.unlisted(origin, clock.awaited_since.get(origin, 0.0)):
                clock.release(origin, "not a live data node of this run")
        now, latest = time.monotonic(), max(clock.heard.values(), default=-1)
        for origin, step in clock.awaited().items():
            if now - clock.awaited_since.get(origin, now) > self.wait_s:
                clock.release(origin, f"its close is {self.wait_s:.0f} s late")
            elif latest >= step + CLOSE_LAG_STEPS:
                clock.release(origin, f"another data node closed step {latest} already")

    async def _drop_unlisted_graphs(self) -> None:
        first: dict[str, float] = {}  # origin -> when we took the first of its graphs we hold
        for saved in self.kept.saved.values():
            first[saved.origin] = min(first.get(saved.origin, saved.taken_at), saved.taken_at)
        for origin, since in sorted(first.items()):
            if await self.admission.unlisted(origin, since):
                dropped = self.kept.forget_origin(origin)
                logger.warning("[%s] dropped %d graph(s) of %s, no live data node of this run: the inner step "
                               "waited for them", self.clock.short_id, dropped, origin[-8:])  # fmt: skip
