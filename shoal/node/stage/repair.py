"""Rebuilding a stage that no live replica holds any more, from its neighbours (CheckFree, CheckFree+).

A node taking a block stage copies a live replica when there is one (stage_copy.py). When there is
none but the swarm has trained, the stage's weights are gone with its last replica. What survives of
it is taken first: the backup a neighbouring stage keeps (backups.py), else, in a run imported
from a checkpoint that this node holds, the checkpoint's own tensors for the stage (the fine-tuning
since is lost, the pretrained model is not: a neighbour mix would lose it). Only then the node asks a
replica of each neighbouring stage for its weights and last gradient norms (the same stream as a
copy), rebuilds the stage by the run's rule (shoal.train.repair), starts a fresh inner optimizer at
`repair.lr_scale` times the schedule, announces the repair in its record, and only then serves.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection

import torch
from hivemind.utils import get_dht_time

from shoal.model.hf import initial_stage
from shoal.node.context import NodeContext
from shoal.node.engine import Repair
from shoal.node.stage.backups import restore_from_backup
from shoal.node.stage.copy import FetchedStage, StageHolder, adopt_stage, fetch_stage
from shoal.planning.backups import backup_keepers
from shoal.planning.swarm_view import STATE_ACTIVE, NodeInfo
from shoal.train.inner import InnerOptimizer
from shoal.train.repair import Neighbour, fresh_weights, plan_repair, rebuild

logger = logging.getLogger(__name__)


def _holders(ctx: NodeContext, stage: int, dead: Collection[str] = ()) -> list[NodeInfo]:
    """Active replicas of `stage` other than us and the `dead`, most trained first."""
    view = ctx.view
    if view is None:
        return []
    found = [n for n in view.replicas(stage)
             if n.state == STATE_ACTIVE and n.peer_id != ctx.peer_id and n.peer_id not in dead]  # fmt: skip
    return sorted(found, key=lambda n: -n.inner_step)


def stage_was_lost(worker: StageHolder, dead: Collection[str] = ()) -> bool:
    """Our stage has no active replica but the `dead` (listed ones that do not answer or did not give
    their weights), and it had one (a dead one), or the swarm has trained: its weights may have gone
    with its last replica. Records lag the training by up to a heartbeat, so a stage that had a
    replica counts as lost until its neighbours say the run never stepped (`repair_stage`)."""
    ctx = worker.ctx
    if ctx.view is None or _holders(ctx, worker.stage, dead):
        return False
    return bool(dead) or _swarm_trained(ctx, dead)


def _swarm_trained(ctx: NodeContext, dead: Collection[str]) -> bool:
    view = ctx.view
    return view is not None and any(
        n.inner_step > 0 for n in view.live_nodes() if n.peer_id != ctx.peer_id and n.peer_id not in dead
    )


async def repair_stage(worker: StageHolder, dead: Collection[str] = ()) -> Repair | None:
    """Rebuild our stage from its neighbours by the run's rule; returns what it did, for our record,
    or None where the neighbours have not stepped either (the run has not: every replica starts
    from the initialisation). `dead`: listed replicas of ours that are gone (named in the log line)."""
    ctx = worker.ctx
    run = ctx.run
    if run.repair.backup_every and backup_keepers(run.pipeline.stages, worker.stage):
        restored = await restore_from_backup(worker, dead)
        if restored is not None:
            return restored
    if run.repair.from_checkpoint and run.model.checkpoint and ctx.checkpoint is not None:
        return await restore_from_checkpoint(worker, dead)
    started = time.monotonic()
    stages = run.pipeline.stages
    available = {s for s in range(1, stages) if s != worker.stage and _holders(ctx, s, dead)}
    plan = plan_repair(worker.stage, stages, available, run.repair.rule)
    shapes = [p.detach() for p in worker.module.parameters()]
    fetched = [got for s in plan.sources if (got := await _fetch_any(ctx, s, shapes, dead)) is not None]
    if all(f.inner_step == 0 for f in fetched) and not _swarm_trained(ctx, dead):
        return None  # nobody has stepped (or nobody answered, and no record says anyone has)
    inner_step = max((f.inner_step for f in fetched), default=_swarm_step(ctx))  # the first it trains
    notes = [plan.note] if plan.note else []
    missing = sorted(set(plan.sources) - {f.stage for f in fetched})
    if missing:
        notes.append(f"stage(s) {missing} gave no usable weights")
    neighbours = [Neighbour(f.stage, f.theta, _norm(f.grad_norm), _norm(f.grad_norm_clipped), f.inner_step)
                  for f in fetched]  # fmt: skip
    repaired = rebuild(plan, neighbours, fresh_weights(run, worker.stage, inner_step), run.repair.weights_from)
    if repaired.note and repaired.note not in notes:
        notes.append(repaired.note)
    own_epoch = worker.averager.epoch if worker.averager is not None else 0
    outer_epoch = max((f.outer_epoch for f in fetched), default=own_epoch)
    worker.optimizer = InnerOptimizer(worker.module, run.optim, run.train.steps, lr_scale=run.repair.lr_scale)
    await adopt_stage(worker, repaired.weights, repaired.weights, inner_step, outer_epoch)
    seconds = time.monotonic() - started
    repair = Repair(
        stage=worker.stage,
        rule=repaired.rule,
        sources=list(repaired.sources),
        inner_step=inner_step,
        seconds=seconds,
        at=float(get_dht_time()),
        note="; ".join(notes)[:200],
    )
    mix = "/".join(f"{w:.2f}" for w in repaired.mix)
    gone = f"its listed replica(s) {sorted(p[-8:] for p in dead)} gave no weights" if dead else "had no replica left"
    logger.warning(
        "[%s] stage %d %s: rebuilt by %s from stage(s) %s%s at inner step %d in %.2f s%s",
        ctx.short_id,
        worker.stage,
        gone,
        repaired.rule,
        list(repaired.sources),
        f" (mix {mix})" if len(repaired.mix) > 1 else "",
        inner_step,
        seconds,
        f" ({repair.note})" if repair.note else "",
    )
    return repair


async def restore_from_checkpoint(worker: StageHolder, dead: Collection[str] = ()) -> Repair:
    """Our stage of an imported run as the checkpoint holds it, with the swarm's counters (from the
    records, which may lag a heartbeat) and a fresh inner optimizer at the schedule's rate. Where the
    run has not stepped, the checkpoint is what every replica started from: the same answer."""
    ctx, run = worker.ctx, worker.ctx.run
    started = time.monotonic()
    module = await asyncio.get_running_loop().run_in_executor(
        None, initial_stage, run.model, run.pipeline.stages, worker.stage, run.train.seed, ctx.checkpoint
    )
    weights = [p.detach() for p in module.parameters()]
    inner_step = _swarm_step(ctx)
    view = ctx.view
    outer_epoch = max((n.outer_epoch for n in view.live_nodes() if n.peer_id not in dead), default=0) if view else 0
    worker.optimizer = InnerOptimizer(worker.module, run.optim, run.train.steps)
    await adopt_stage(worker, weights, weights, inner_step, outer_epoch)
    seconds = time.monotonic() - started
    logger.warning("[%s] stage %d had no replica and no backup left: restored from the checkpoint's own tensors "
                   "(%s) in %.2f s; the fine-tuning of its %d steps since is lost, the pretrained model is not",
                   ctx.short_id, worker.stage, ctx.checkpoint.path.name, seconds, inner_step)  # fmt: skip
    return Repair(stage=worker.stage, rule="checkpoint", sources=[], inner_step=inner_step, seconds=seconds,
                  at=float(get_dht_time()), note="the run's checkpoint; its fine-tuning since is lost")  # fmt: skip


async def _fetch_any(
    ctx: NodeContext, stage: int, reference: list[torch.Tensor], dead: Collection[str] = ()
) -> FetchedStage | None:
    """The weights of `stage` from the first of its replicas that gives them."""
    for holder in _holders(ctx, stage, dead):
        try:
            timeout_s = ctx.config.network.rpc_timeout_s
            return await fetch_stage(ctx.transport, holder.peer_id, stage, reference, timeout_s, run=ctx.run)
        except Exception as e:
            logger.warning("[%s] stage %d from %s for a repair: %s", ctx.short_id, stage, holder.peer_id[-8:], e)
            ctx.suspects.mark(holder.peer_id, f"stage copy for a repair failed: {e}")
    return None


def _norm(value: float | None) -> float:
    """An unknown norm (a neighbour that has not stepped yet) weighs as the mean of the known ones."""
    return math.nan if value is None else value


def _swarm_step(ctx: NodeContext) -> int:
    view = ctx.view
    return max((n.inner_step for n in view.live_nodes()), default=0) if view is not None else 0
