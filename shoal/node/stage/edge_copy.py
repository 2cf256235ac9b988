"""CheckFree+ for stage 0 (papers/checkfree.md: "E and E⁻¹ are copied to the neighbouring stages, so
they are recovered exactly"). Stage 0 (embedding, final norm, LM head) is held by the data nodes;
no neighbour average can rebuild it, because no block stage is shaped like it. Under
`repair.rule = "checkfree_plus"` the workers of its two neighbours in the ring, block stages 1 and
S-1, keep a copy: every `repair.edge_copy_every` of their own inner steps they fetch θ and φ of
stage 0 from the most trained live data node, through the same `rpc_copy_stage` a joining data node
uses. A data node that starts with nothing (no save, no live data node to copy) takes stage 0 from
the freshest such copy instead of a fresh initialisation, and goes on from its step.

Where the paper copies E and E⁻¹ at every step (recovery is exact), a copy here is up to
`edge_copy_every` steps old: a recovered stage 0 has lost at most that many of its own updates. The
cost is O(|stage 0|) memory on each neighbour (θ and φ) and one copy stream per period per neighbour.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from shoal.model.stages import build_stage
from shoal.node.stage.copy import WIRE_DTYPE, DonorBusy, FetchedStage, StageHolder, adopt_stage, fetch_stage
from shoal.p2p.streams import FramedStream
from shoal.planning.swarm_view import STATE_ACTIVE
from shoal.protocol.pipeline import Ack, StageCopy

logger = logging.getLogger(__name__)

POLL_S = 0.5


def keeps_edge_copy(rule: str, stages: int, stage: int) -> bool:
    """Whether a worker of `stage` keeps a copy of stage 0: under CheckFree+, stage 0's neighbours."""
    return rule == "checkfree_plus" and stage in (1, stages - 1)


def stage0_reference(holder: StageHolder) -> list[torch.Tensor]:
    """Empty host tensors shaped like stage 0's parameters: what a fetched copy is checked against."""
    run = holder.ctx.run
    with torch.device("meta"):
        shapes = [p.shape for p in build_stage(run.model, run.pipeline.stages, 0, run.train.seed).parameters()]
    return [torch.empty(shape) for shape in shapes]


class EdgeCopyKeeper:
    """On a worker of stage 1 or S-1: keeps a copy of stage 0, refreshed every `every` inner steps."""

    def __init__(self, worker: StageHolder, every: int) -> None:
        self.worker, self.every = worker, every
        self.copy: FetchedStage | None = None  # stage 0 as a data node last gave it, on host memory
        self.fetches = 0
        self.failures = 0
        self.served = 0
        self._reference: list[torch.Tensor] | None = None

    async def run(self) -> None:
        """Fetch a copy whenever our inner step has moved `every` past the last one (and at step 1)."""
        next_at = 1
        while True:
            await asyncio.sleep(POLL_S)
            if self.worker.optimizer.step_count < next_at:
                continue
            if await self.refresh():
                next_at = self.worker.optimizer.step_count + self.every

    async def refresh(self) -> bool:
        """Copy stage 0 from the most trained live data node that gives it; whether one did."""
        ctx = self.worker.ctx
        view = ctx.view
        if view is None:
            return False
        holders = sorted((n for n in view.replicas(0) if n.state == STATE_ACTIVE and n.peer_id != ctx.peer_id),
                         key=lambda n: -n.inner_step)  # fmt: skip
        if self._reference is None:
            self._reference = stage0_reference(self.worker)
        for holder in holders:
            try:
                fetched = await fetch_stage(ctx.transport, holder.peer_id, 0, self._reference,
                                            ctx.config.network.rpc_timeout_s, wait_if_busy=False,
                                            run=ctx.run)  # fmt: skip
            except DonorBusy:
                continue
            except Exception as e:
                self.failures += 1
                logger.info("[%s] could not copy stage 0 from %s: %s", ctx.short_id, holder.peer_id[-8:], e)
                continue
            if self.copy is None:
                logger.info("[%s] CheckFree+: keeping a copy of stage 0 (from %s, inner step %d), refreshed every "
                            "%d steps", ctx.short_id, holder.peer_id[-8:], fetched.inner_step, self.every)  # fmt: skip
            self.copy = fetched
            self.fetches += 1
            return True
        return False

    async def serve(self, stream: FramedStream) -> None:
        """Answer a data node rebuilding stage 0, as `serve_stage_copy` answers for a held stage."""
        copy = self.copy
        if copy is None:
            await stream.write_message(Ack(accepted=False, reason="no copy of stage 0 kept here yet"))
            return
        await stream.write_message(Ack(accepted=True))
        await stream.write_message(
            StageCopy(inner_step=copy.inner_step, outer_epoch=copy.outer_epoch, tensors=len(copy.theta))
        )
        for tensor in (*copy.theta, *copy.phi):
            await stream.write_tensor(tensor, WIRE_DTYPE, kind="copy")
        self.served += 1

    def stats(self) -> dict[str, Any]:
        copy = self.copy
        return {
            "fetches": self.fetches,
            "failures": self.failures,
            "served": self.served,
            "inner_step": copy.inner_step if copy is not None else None,
            "source": copy.peer_id if copy is not None else None,
        }


async def recover_stage0(driver: StageHolder) -> str | None:
    """A data node with nothing to start from takes stage 0 from the freshest copy its neighbours keep;
    returns whose copy it took (None: no neighbour had one, and stage 0 starts from its initialisation)."""
    ctx = driver.ctx
    view = ctx.view
    run = ctx.run
    if view is None or run.repair.rule != "checkfree_plus":
        return None
    keepers = [n for s in sorted({1, run.pipeline.stages - 1}) for n in view.replicas(s) if n.state == STATE_ACTIVE]
    reference = [p.detach() for p in driver.module.parameters()]
    copies = []
    for keeper in keepers:
        try:
            timeout_s = ctx.config.network.rpc_timeout_s
            fetched = await fetch_stage(ctx.transport, keeper.peer_id, 0, reference, timeout_s, wait_if_busy=False,
                                        run=run)  # fmt: skip
            copies.append(fetched)
        except Exception as e:
            logger.info("[%s] no copy of stage 0 from %s: %s", ctx.short_id, keeper.peer_id[-8:], e)
    if not copies:
        return None
    best = max(copies, key=lambda c: c.inner_step)
    await adopt_stage(driver, best.theta, best.phi, best.inner_step, best.outer_epoch)
    logger.info("[%s] CheckFree+: stage 0 taken from the copy stage %d's %s keeps (inner step %d)", ctx.short_id,
                next(n.stage for n in keepers if n.peer_id == best.peer_id), best.peer_id[-8:],
                best.inner_step)  # fmt: skip
    return best.peer_id
