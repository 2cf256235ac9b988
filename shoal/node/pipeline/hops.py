"""What a hop is, for both pipeline engines: how long a hop may wait for its planned start or a step
close, the bound on what a peer may send, and how a hop that nobody took fails (`HopFailed`). The engine
that sends hops, redoes lost ones and keeps its peers' bans is base.py's `PipelineEngine`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from shoal.node.engine import AbandonReason

MAX_PLANNED_HOLD_S = 5.0  # the longest a hop waits for its planned start (SkipPipe's timetable)
STEP_CLOSE_TIMEOUT_S = 10.0  # on top of twice the run's averaging exchange timeout: a close may carry an outer step


def step_close_patience_s(exchange_timeout_s: float) -> float:
    """How long handling a step close may take: a data node waits this long for a worker's answer, and
    a worker holds the next step's forwards no longer than this while it handles the close itself."""
    return STEP_CLOSE_TIMEOUT_S + 2 * exchange_timeout_s


# Activations and gradients a peer sends are refused beyond this magnitude (float16's range, so the
# bound is the same whatever the wire dtype): finite but huge values would overflow the first norm.
WIRE_MAX_ABS = 65504.0


class HopFailed(Exception):
    """The receiver did not take the work: unreachable, timed out, refused, or answered an error.

    `refused` is True when the receiver answered (an error reply or a declined Ack): it is alive and
    said no. Otherwise the stream itself failed, which may be transient."""

    def __init__(self, message: str, refused: bool = False, stage_lost: bool = False):
        super().__init__(message)
        self.refused = refused
        self.stage_lost = stage_lost  # a stage on the way had no live replica for the whole stage wait


async def planned_start(starts: Sequence[float], hop: int) -> None:
    """SkipPipe's timetable: wait for hop `hop`'s planned start (wall-clock seconds, the clock the DHT's
    expirations already assume peers share), at most MAX_PLANNED_HOLD_S: a start further off is a
    sender's error or a clock far off, and not worth a microbatch. No plan (`starts` empty): at once."""
    if 0 <= hop < len(starts):
        await asyncio.sleep(min(max(0.0, starts[hop] - time.time()), MAX_PLANNED_HOLD_S))


def lost_kind(error: HopFailed, otherwise: AbandonReason) -> AbandonReason:
    """What a microbatch lost to `error` is counted as: `stage_lost`, or the kind of hop that failed."""
    return AbandonReason.STAGE_LOST if error.stage_lost else otherwise
