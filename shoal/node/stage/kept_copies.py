"""CheckFree+'s copies of stage 0, kept in memory by the workers of its neighbouring stages, so that a
lost stage 0 comes back as it was (papers/checkfree.md: "E and E⁻¹ are copied to the neighbouring
stages, so they are recovered exactly"). Stage 0 (embedding, final norm, LM head) is held by the data
nodes; no neighbour average can rebuild it, because no block stage is shaped like it. Under
`repair.rule = "checkfree_plus"` the workers of its two neighbours in the ring, block stages 1 and
S-1, keep a copy (θ and φ), refreshed every `repair.edge_copy_every` of their own inner steps, through
the same `rpc_copy_stage` a joiner uses (every tensor checked: count, shapes, dtype, finite, and the
counters against the run). A data node that starts with nothing (no save, no live data node to copy)
takes stage 0 from the freshest copy. Block stages have backups of their own (backups.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import torch

from shoal.config import RunConfig
from shoal.model.stages import build_stage
from shoal.node.stage.copy import WIRE_DTYPE, DonorBusy, FetchedStage, StageHolder, adopt_stage, fetch_stage
from shoal.p2p.streams import FramedStream
from shoal.planning.swarm_view import STATE_ACTIVE, NodeInfo
from shoal.protocol.pipeline import Ack, StageCopy

logger = logging.getLogger(__name__)

POLL_S = 0.5


def stage_reference(run: RunConfig, stage: int) -> list[torch.Tensor]:
    """Empty host tensors shaped like `stage`'s parameters: what a fetched copy is checked against."""
    with torch.device("meta"):
        shapes = [p.shape for p in build_stage(run.model, run.pipeline.stages, stage, run.train.seed).parameters()]
    return [torch.empty(shape) for shape in shapes]


class StageCopyKeeper:
    """On a worker: keeps a copy of neighbouring `stage`, refreshed every `every` of its inner steps."""

    def __init__(self, worker: StageHolder, stage: int, every: int, rule: str) -> None:
        self.worker, self.stage, self.every, self.rule = worker, stage, every, rule
        self.copy: FetchedStage | None = None  # the stage as a replica last gave it, on host memory
        self.fetches = 0
        self.failures = 0
        self.served = 0
        self.bytes_fetched = 0
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
        """Copy the stage from its most trained live replica that gives it; whether one did."""
        ctx = self.worker.ctx
        view = ctx.view
        if view is None:
            return False
        holders = sorted((n for n in view.replicas(self.stage) if n.state == STATE_ACTIVE and n.peer_id != ctx.peer_id),
                         key=lambda n: -n.inner_step)  # fmt: skip
        if self._reference is None:
            self._reference = stage_reference(ctx.run, self.stage)
        for holder in holders:
            try:
                fetched = await fetch_stage(ctx.transport, holder.peer_id, self.stage, self._reference,
                                            ctx.config.network.rpc_timeout_s, wait_if_busy=False,
                                            run=ctx.run)  # fmt: skip
            except DonorBusy:
                continue
            except Exception as e:
                self.failures += 1
                logger.info("[%s] could not copy stage %d from %s: %s", ctx.short_id, self.stage, holder.peer_id[-8:],
                            e)  # fmt: skip
                continue
            if self.copy is None:
                logger.info("[%s] %s: keeping a copy of stage %d (from %s, inner step %d), refreshed every %d steps",
                            ctx.short_id, self.rule, self.stage, holder.peer_id[-8:], fetched.inner_step,
                            self.every)  # fmt: skip
            self._keep(fetched)
            return True
        return False

    def _keep(self, fetched: FetchedStage) -> None:
        self.copy = fetched
        self.fetches += 1
        self.bytes_fetched += sum(t.numel() * 4 for t in (*fetched.theta, *fetched.phi))  # float32 on the wire

    async def take_from(self, peer: str) -> bool:
        """A joiner's first copy: the one kept by the replica it copied its own stage from, so that a
        backup outlives its keepers' restarts as long as one replica of the keeping stage lives (the
        stage it backs up may have none left to copy from by then); whether that replica had one."""
        ctx = self.worker.ctx
        if self._reference is None:
            self._reference = stage_reference(ctx.run, self.stage)
        try:
            fetched = await fetch_stage(ctx.transport, peer, self.stage, self._reference,
                                        ctx.config.network.rpc_timeout_s, wait_if_busy=False, run=ctx.run)  # fmt: skip
        except Exception as e:
            logger.info("[%s] %s: %s kept no copy of stage %d for us: %s", ctx.short_id, self.rule, peer[-8:],
                        self.stage, e)  # fmt: skip
            return False
        self._keep(fetched)
        logger.info("[%s] %s: took over the copy of stage %d that %s keeps (inner step %d)", ctx.short_id, self.rule,
                    self.stage, peer[-8:], fetched.inner_step)  # fmt: skip
        return True

    async def serve(self, stream: FramedStream) -> None:
        """Answer a node restoring the stage, as `serve_stage_copy` answers for a held stage."""
        copy = self.copy
        if copy is None:
            await stream.write_message(Ack(accepted=False, reason=f"no copy of stage {self.stage} kept here yet"))
            return
        await stream.write_message(Ack(accepted=True))
        await stream.write_message(
            StageCopy(
                inner_step=copy.inner_step,
                outer_epoch=copy.outer_epoch,
                tensors=len(copy.theta),
                grad_norm=copy.grad_norm,
                grad_norm_clipped=copy.grad_norm_clipped,
            )  # fmt: skip
        )
        for tensor in (*copy.theta, *copy.phi):
            await stream.write_tensor(tensor, WIRE_DTYPE, kind="copy")
        self.served += 1

    def stats(self) -> dict[str, Any]:
        copy = self.copy
        return {
            "stage": self.stage,
            "fetches": self.fetches,
            "failures": self.failures,
            "served": self.served,
            "bytes_fetched": self.bytes_fetched,
            "bytes_held": sum(t.numel() * t.element_size() for t in (*copy.theta, *copy.phi)) if copy else 0,
            "inner_step": copy.inner_step if copy is not None else None,
            "source": copy.peer_id if copy is not None else None,
        }


async def _freshest_copy(holder: StageHolder, stage: int, keepers: list[NodeInfo]) -> FetchedStage | None:
    """The most trained copy of `stage` that any of `keepers` gives (None: none had one)."""
    ctx = holder.ctx
    reference = [p.detach() for p in holder.module.parameters()]
    copies = []
    for keeper in keepers:
        try:
            timeout_s = ctx.config.network.rpc_timeout_s
            fetched = await fetch_stage(ctx.transport, keeper.peer_id, stage, reference, timeout_s, wait_if_busy=False,
                                        run=ctx.run)  # fmt: skip
            copies.append(fetched)
        except Exception as e:
            logger.info("[%s] no copy of stage %d from %s: %s", ctx.short_id, stage, keeper.peer_id[-8:], e)
    return max(copies, key=lambda c: c.inner_step, default=None)


def active_replicas(holder: StageHolder, stages: Collection[int], dead: Collection[str] = ()) -> list[NodeInfo]:
    view, me = holder.ctx.view, holder.ctx.peer_id
    if view is None:
        return []
    return [n for s in sorted(stages) for n in view.replicas(s)
            if n.state == STATE_ACTIVE and n.peer_id != me and n.peer_id not in dead]  # fmt: skip


async def recover_stage0(driver: StageHolder) -> str | None:
    """A data node with nothing to start from takes stage 0 from the freshest copy its neighbours keep;
    returns whose copy it took (None: no neighbour had one, and stage 0 starts from its initialisation)."""
    ctx, run = driver.ctx, driver.ctx.run
    if run.repair.rule != "checkfree_plus":
        return None
    keepers = active_replicas(driver, {1, run.pipeline.stages - 1})
    best = await _freshest_copy(driver, 0, keepers)
    if best is None:
        return None
    await adopt_stage(driver, best.theta, best.phi, best.inner_step, best.outer_epoch)
    logger.info("[%s] CheckFree+: stage 0 taken from the copy stage %d's %s keeps (inner step %d)", ctx.short_id,
                next(n.stage for n in keepers if n.peer_id == best.peer_id), best.peer_id[-8:],
                best.inner_step)  # fmt: skip
    return best.peer_id
