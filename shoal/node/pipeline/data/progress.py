"""What a data node tells its operator while it trains: the progress file (one JSON event per line:
start, step, waiting, repair, excluded, done) and the watch over stages that have no live replica."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

from shoal.node.context import NodeContext
from shoal.node.pipeline.base import STAGE_POLL_S
from shoal.node.pipeline.data.ledger import MicrobatchLedger
from shoal.planning.swarm_view import SwarmView

logger = logging.getLogger(__name__)

WAIT_REPORT_S = 10.0


class ProgressFile:
    """`--progress-file`: appended to, one event a line; nothing is written without a path."""

    def __init__(self, path: str | None):
        self.path = path

    def write(self, event: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")


class StageWatch:
    """While training, say (in the log, the progress file and, through `waiting_for`, the node record)
    which block stages have no live replica: the run is waiting for them, wherever its microbatches
    are held (at the data node for a route, or at a worker waiting for a replacement hop). Also marks
    the step at which a worker said it rebuilt a lost stage."""

    def __init__(self, ctx: NodeContext, progress: ProgressFile, ledger: MicrobatchLedger):
        self.ctx = ctx
        self.progress = progress
        self.ledger = ledger
        self.waiting_for: list[int] = []
        self.repairs_seen: set[tuple[str, float]] = set()
        self._last_report = 0.0

    async def run(self, finished: asyncio.Event, current_step: Callable[[], int]) -> None:
        while not finished.is_set():
            view = self.ctx.view
            missing = view.stages_without_replica() if view is not None else []
            self.waiting_for = missing
            if missing and time.monotonic() - self._last_report >= WAIT_REPORT_S:
                logger.warning("[%s] waiting for a live replica of stage(s) %s", self.ctx.short_id, missing)
                self.progress.write({"event": "waiting", "stages": missing, "ledger": self.ledger.summary()})
                self._last_report = time.monotonic()
            elif not missing:
                self._last_report = 0.0
            self.note_repairs(view, current_step())
            await asyncio.sleep(STAGE_POLL_S)

    def note_repairs(self, view: SwarmView | None, step: int) -> None:
        """A worker that rebuilt a lost stage says so in its record: mark the step it happened at."""
        for node in view.live_nodes() if view is not None else ():
            repair = node.repair
            if repair is None or (node.peer_id, repair.at) in self.repairs_seen:
                continue
            self.repairs_seen.add((node.peer_id, repair.at))
            logger.info("[%s] stage %d rebuilt by %s from %s", self.ctx.short_id, repair.stage, repair.rule,
                        list(repair.sources))  # fmt: skip
            self.progress.write({"event": "repair", "step": step, "peer_id": node.peer_id, **asdict(repair)})
