"""The stage replicas a data node excludes from its routes for good, and why: those its audits blamed
(auditor.py, step_audits.py), and those that at least two others of their stage refused as averaging
partners (their records' `excluded`, under the robust outer step). They are listed with the reason in
the data node's record, so `shoal status` shows them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shoal.logs import printable
from shoal.node.context import NodeContext
from shoal.node.pipeline.data.progress import ProgressFile
from shoal.planning.swarm_view import SwarmView
from shoal.train.audit import refused_by_partners

logger = logging.getLogger(__name__)

MAX_EXCLUDED_LISTED = 16  # in the node record (shoal.dht.records.MAX_EXCLUDED)


class Exclusions:
    """`current_step`: the training step an exclusion is marked at in the progress file."""

    def __init__(self, ctx: NodeContext, progress: ProgressFile, current_step: Callable[[], int]):
        self.ctx, self.progress, self.current_step = ctx, progress, current_step
        self.excluded: dict[str, str] = {}  # peer -> why, in the order they were excluded

    def peers(self) -> set[str]:
        return set(self.excluded)

    def record(self) -> list[dict]:
        """The exclusions as node-record entries (the latest MAX_EXCLUDED_LISTED)."""
        items = list(self.excluded.items())[-MAX_EXCLUDED_LISTED:]
        return [{"peer_id": peer, "reason": reason} for peer, reason in items]

    def exclude(self, peer: str, reason: str) -> None:
        if peer in self.excluded:
            return
        self.excluded[peer] = printable(reason, 200)
        logger.warning("[%s] excluded %s from its routes: %s", self.ctx.short_id, peer[-8:], self.excluded[peer])
        self.progress.write({"event": "excluded", "step": self.current_step(), "peer_id": peer,
                             "reason": self.excluded[peer]})  # fmt: skip

    def on_view(self, view: SwarmView) -> None:
        """Take up the robust outer step's verdicts that workers publish (see refused_by_partners)."""
        if not self.ctx.run.defense.robust_outer:
            return
        workers = {n.peer_id: n.stage for n in view.live_nodes() if n.stage > 0}
        refusals = {n.peer_id: {peer for peer, _ in n.excluded} for n in view.live_nodes() if n.stage > 0}
        for peer, reason in refused_by_partners(refusals, workers, ignore=self.peers()).items():
            self.exclude(peer, f"stage {workers[peer]}: {reason}")
