"""The node's engines, one factory per role: a data node (`DataDriver`), a stage worker (`StageWorker`)
and a rollout worker (`RolloutWorker`), each built, joined to what the swarm already trained and
started the way its protocol needs; and the parts every engine's context holds (router, hooks).

A factory installs its engine on the node (`EngineSetup.install`) at the point its protocol needs: a
stage worker before it copies a replica's weights, for it serves RPCs while it does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.config import RunConfig
from shoal.errors import UsageError
from shoal.node.config import NodeConfig
from shoal.node.context import NodeContext
from shoal.node.engine import Engine
from shoal.node.hooks import Faults, Hooks
from shoal.node.machine import Machine
from shoal.node.pipeline.data.driver import DataDriver
from shoal.node.pipeline.worker.stage import StageWorker
from shoal.node.rollout.worker import RolloutWorker
from shoal.planning.costs import CostModel
from shoal.planning.memory import fits, policy_memory
from shoal.planning.memory import refusal as memory_refusal
from shoal.planning.swarm_view import ROLE_DATA, ROLE_ROLLOUT, ROLE_WORKER, STATE_ACTIVE, StageIndex, SwarmView

logger = logging.getLogger(__name__)


def run_cost_model(run: RunConfig) -> CostModel:
    """The planners' time model for this run: one microbatch's activation on the wire."""
    from shoal.protocol.tensors import wire_nbytes

    t, m = run.train, run.model
    return CostModel(
        activation_bytes=wire_nbytes((t.microbatch_size, t.seq_len, m.residual_dim), run.pipeline.wire_dtype)
    )


def routing_policy(config: NodeConfig, run: RunConfig) -> str:
    """With NoLoCo, microbatches mix over random replicas (the paper's point); otherwise GWTF."""
    if config.placement.routing != "auto":
        return config.placement.routing
    return "random" if run.averaging.mode == "noloco" else "gwtf"


def node_hooks(config: NodeConfig) -> Hooks:
    """The node's fault injection and experiment (`--inject-*`, `--experiment-adversary`); by default none."""
    faults = Faults(
        crash_at_step=config.experiment.crash_at_step,
        forward_delay_s=config.experiment.forward_delay_s,
        upstream_delay=config.experiment.upstream_delay,
        close_delay_s=config.experiment.close_delay_s,
        copy_delay_s=config.experiment.copy_delay_s,
        close_stall=config.experiment.close_stall,
    )
    return Hooks(faults, config.experiment.adversary)


@dataclass(frozen=True)
class EngineSetup:
    """What a factory gets of the node."""

    context: NodeContext
    stage: StageIndex
    machine: Machine
    listed: SwarmView | None  # the last view read, suspects included
    install: Callable[[Engine], None]  # make it the node's engine (serving its RPCs, reporting its progress)
    resume: Callable[[Engine], Awaitable[bool]]  # --state-dir: whether it now holds trained weights from it


async def start_data_node(setup: EngineSetup) -> Engine:
    """Stage 0: its shard of the data, its saved state or the data nodes' current stage 0."""
    ctx = setup.context
    shard, shards = ctx.config.placement.data_shard
    driver = DataDriver(ctx, shard, shards, ctx.config.output.progress_file)
    await driver.start()
    setup.install(driver)
    if not await setup.resume(driver):
        await driver.join_by_copy()  # stage 0 of a run that averages it: the data nodes' current one
    return driver


async def start_stage_worker(setup: EngineSetup) -> Engine:
    """A block stage: the weights are its own saved ones, a live replica's, or (before the run has
    stepped) the checkpoint's or the initialisation, as every replica's were."""
    ctx, stage = setup.context, setup.stage
    worker = StageWorker(ctx, stage)
    setup.install(worker)
    resumed = await setup.resume(worker)  # whose weights: our own saved ones, or a replica's copied
    source = ctx.peer_id if resumed else await worker.join_by_copy()  # before we announce ourselves active
    listed = setup.listed.replicas(stage, exclude=ctx.peer_id) if setup.listed is not None else []
    silent = {n.peer_id for n in listed if n.state == STATE_ACTIVE and n.peer_id in ctx.suspects}
    if source is None and await worker.repair_if_lost(silent) is None:
        if ctx.run.model.checkpoint and ctx.checkpoint is None:
            raise UsageError(f"run {ctx.run.name} starts from a checkpoint, and no live replica of stage "
                             f"{stage} gave its weights: give --checkpoint DIR")  # fmt: skip
        if worker.failed_donors or silent:
            logger.info("[%s] stage %d: no listed replica gave its weights, and the run has not stepped "
                        "yet: starting %s, as every replica did", ctx.short_id, stage,
                        "from the checkpoint" if ctx.checkpoint else "from the initialisation")  # fmt: skip
    await worker.start()
    return worker


async def start_rollout_worker(setup: EngineSetup) -> Engine:
    """GRPO: the policy this node post-trains (the run's checkpoint, its own, or one of `--width` and
    `--depth`), refused where this machine's memory does not hold a round of it; warmed up."""
    from shoal.grpo.policy import CheckpointPolicySpec, PolicySpec, check_policy_checkpoint, rollout_seq_len
    from shoal.grpo.tasks import get_task
    from shoal.model.corpus import cache_dir

    ctx = setup.context
    run, checkpoint, p = ctx.run, ctx.checkpoint, ctx.config.policy
    assert run.grpo is not None
    if run.grpo.policy_checkpoint and checkpoint is None:
        raise UsageError(f"run {run.name} post-trains a checkpoint (grpo.policy.from): give --checkpoint DIR")
    if checkpoint is not None:
        spec = CheckpointPolicySpec(run.grpo.task, checkpoint, seed=p.seed, warmup_steps=p.warmup_steps,
                                    train_last=run.grpo.train_last)  # fmt: skip
        try:
            check_policy_checkpoint(spec)
        except ValueError as e:
            raise UsageError(f"checkpoint {checkpoint.path}: {e}") from None
        own = "the run's" if checkpoint.model.checkpoint == run.grpo.policy_checkpoint else "its own"
        logger.info("[%s] post-training %s checkpoint %s (weights %s)", ctx.short_id, own, checkpoint.path,
                    checkpoint.model.checkpoint[:12])  # fmt: skip
    else:
        spec = PolicySpec(task=run.grpo.task, d_model=p.width, n_layers=p.depth, n_heads=p.heads,
                          seed=p.seed, warmup_steps=p.warmup_steps)  # fmt: skip
    g = run.grpo
    rows = g.prompts_per_round * g.group_size * (1 + g.max_peers)  # its own samples and its peers' at most
    seq_len = min(spec.model_config().max_seq_len, rollout_seq_len(spec))  # a prompt and its completion
    need = policy_memory(spec.model_config(), rows, seq_len, get_task(spec.task).max_new_tokens, spec.train_last)
    if not fits(need, setup.machine.memory_bytes):
        raise UsageError(f"{memory_refusal(need, setup.machine.memory_bytes)}{setup.machine.limited}")
    worker = RolloutWorker(ctx, spec, Path(p.cache) if p.cache else cache_dir() / "grpo")
    await worker.start()
    setup.install(worker)
    return worker


@dataclass(frozen=True)
class EngineFactory:
    start: Callable[[EngineSetup], Awaitable[Engine]]
    work: str | None  # the task that runs the engine's own loop (`Engine.work`); None: it only answers peers


ENGINES: dict[str, EngineFactory] = {
    ROLE_DATA: EngineFactory(start_data_node, work="train"),
    ROLE_WORKER: EngineFactory(start_stage_worker, work=None),
    ROLE_ROLLOUT: EngineFactory(start_rollout_worker, work="rounds"),
}
"""The engine each role runs (planning/swarm_view.py's roles)."""
