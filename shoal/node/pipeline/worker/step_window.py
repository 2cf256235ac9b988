"""Which step numbers a stage worker takes from a peer: a data node's step, named by its training
forwards, its recomputes and its step closes, moves our inner step, the learning-rate schedule and the
`inner_step` our record publishes, so it is checked against what this worker can justify before it
touches any of them.

The window is [0, highest]: highest is the latest step anyone we can vouch for stands at (our own
inner step, the latest close we handled, and each listed data node's published `inner_step`) plus
STEP_HEADROOM, and never past the run's last step. A data node sends its close of step s while its
record says `inner_step` s (it steps stage 0 after closing), so an honest close lies inside the
window; the headroom covers a record a heartbeat old, and a worker that just joined. An evaluation
forward names step -1 and moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.node.context import NodeContext
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.planning.swarm_view import ROLE_DATA

# Steps a data node may stand ahead of the latest we can vouch for: its record is at most a heartbeat
# old after a fresh read (2-10 s), and no run of ours steps this often in one heartbeat.
STEP_HEADROOM = 64


class StepWindow:
    """The steps a worker takes; `own_step` is its inner optimizer's step count (a restore replaces
    the optimizer, so it is read each time)."""

    def __init__(self, ctx: NodeContext, clock: StepClock, own_step: Callable[[], int]) -> None:
        self.ctx, self.clock, self.own_step = ctx, clock, own_step
        self.last_step = ctx.run.train.steps - 1  # a data node's step loop ends there

    def highest(self) -> int:
        """The latest step a peer may name now."""
        view = self.ctx.view
        published = [n.inner_step for n in view.live_nodes() if n.role == ROLE_DATA] if view is not None else []
        vouched = max(self.own_step(), self.clock.closed_step + 1, *published)
        return min(self.last_step, vouched + STEP_HEADROOM)

    def refusal(self, step: int, training: bool = True) -> str | None:
        """Why `step` is not one a peer may name, if it is not (`training`: a step that may move our
        clock; an evaluation names -1)."""
        lowest = 0 if training else -1
        if step < lowest:
            return f"step {step} is below {lowest}"
        highest = self.highest()
        if step > highest:
            return f"step {step} is beyond any this worker can vouch for (at most {highest})"
        return None
