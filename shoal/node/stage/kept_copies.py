"""Copies of a stage kept in memory by workers of a neighbouring stage, so that a stage that loses
every replica comes back as it was instead of being rebuilt. Two rules keep them:

- CheckFree+ for stage 0 (papers/checkfree.md: "E and E⁻¹ are copied to the neighbouring stages, so
  they are recovered exactly"). Stage 0 (embedding, final norm, LM head) is held by the data nodes;
  no neighbour average can rebuild it, because no block stage is shaped like it. Under
  `repair.rule = "checkfree_plus"` the workers of its two neighbours in the ring, block stages 1 and
  S-1, keep a copy, refreshed every `repair.edge_copy_every` of their own inner steps. A data node
  that starts with nothing (no save, no live data node to copy) takes stage 0 from the freshest copy.
- Stage backups, a rule beyond the papers (`repair.backup_every`, on by default): every block stage
  is kept by the workers of one neighbouring block stage (stage s by stage s+1's workers, the last
  block stage by the first's: a ring over the block stages), refreshed every `backup_every` of the
  keeper's own inner steps. A node taking a block stage that has no live replica restores it from
  the freshest backup, θ and φ, so that NoLoCo's catch-up starts from the stage's own slow weights,
  and only where no backup is left rebuilds it by the run's rule (CheckFree's neighbour mix). For a
  model trained from scratch by the swarm a mix is the papers' answer; for a pretrained model it is
  no repair: one lost stage of SmolLM2-135M rebuilt from its neighbour sent the loss from 2.89 to 18.5.

A copy is up to `every` steps old: a restored stage has lost at most that many of its own updates,
and its AdamW moments (not kept: they would double the cost), so its optimizer starts fresh. The cost
is the kept stage's θ and φ in host memory on each keeper, and one copy stream per period per keeper,
through the same `rpc_copy_stage` a joiner uses (every tensor checked: count, shapes, dtype, finite,
and the counters against the run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

import torch
from hivemind.utils import get_dht_time

from shoal.config import RunConfig
from shoal.model.stages import build_stage
from shoal.node.engine import Repair
from shoal.node.stage.copy import WIRE_DTYPE, DonorBusy, FetchedStage, StageHolder, adopt_stage, fetch_stage
from shoal.p2p.streams import FramedStream
from shoal.planning.backups import backup_keepers
from shoal.planning.swarm_view import STATE_ACTIVE, NodeInfo
from shoal.protocol.pipeline import Ack, StageCopy
from shoal.train.inner import InnerOptimizer

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


def _active(holder: StageHolder, stages: Collection[int], dead: Collection[str] = ()) -> list[NodeInfo]:
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
    keepers = _active(driver, {1, run.pipeline.stages - 1})
    best = await _freshest_copy(driver, 0, keepers)
    if best is None:
        return None
    await adopt_stage(driver, best.theta, best.phi, best.inner_step, best.outer_epoch)
    logger.info("[%s] CheckFree+: stage 0 taken from the copy stage %d's %s keeps (inner step %d)", ctx.short_id,
                next(n.stage for n in keepers if n.peer_id == best.peer_id), best.peer_id[-8:],
                best.inner_step)  # fmt: skip
    return best.peer_id


async def restore_from_backup(worker: StageHolder, dead: Collection[str] = ()) -> Repair | None:
    """A block stage with no live replica: take it back from the freshest backup its keepers hold, with
    a fresh inner optimizer at the schedule's rate; returns the repair for our record (None: no keeper
    held a trained backup, and the caller rebuilds the stage by the run's rule, saying so)."""
    ctx, run = worker.ctx, worker.ctx.run
    started = time.monotonic()
    stages = backup_keepers(run.pipeline.stages, worker.stage)
    keepers = _active(worker, stages, dead)
    best = await _freshest_copy(worker, worker.stage, keepers)
    if best is None or best.inner_step == 0:
        logger.warning("[%s] stage %d: no backup of it left (keepers: stage(s) %s, %d live): falling back to %s",
                       ctx.short_id, worker.stage, stages, len(keepers), run.repair.rule)  # fmt: skip
        return None
    keeper_stage = next(n.stage for n in keepers if n.peer_id == best.peer_id)
    worker.optimizer = InnerOptimizer(worker.module, run.optim, run.train.steps)
    await adopt_stage(worker, best.theta, best.phi, best.inner_step, best.outer_epoch)
    seconds = time.monotonic() - started
    logger.warning("[%s] stage %d had no replica left: restored from the backup stage %d's %s keeps (inner step %d, "
                   "outer epoch %d) in %.2f s", ctx.short_id, worker.stage, keeper_stage, best.peer_id[-8:],
                   best.inner_step, best.outer_epoch, seconds)  # fmt: skip
    return Repair(stage=worker.stage, rule="backup", sources=[keeper_stage], inner_step=best.inner_step,
                  seconds=seconds, at=float(get_dht_time()), note=f"the backup {best.peer_id[-8:]} kept")  # fmt: skip
