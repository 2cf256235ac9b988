"""The node daemon: join the swarm, announce a signed record, hold a stage, leave cleanly.

Lifecycle: `Node.create()` starts libp2p and the DHT node, resolves the run, measures this
machine, picks a stage, serves RPCs and starts the heartbeat; `run_until_stopped()` serves until
`request_stop()` (SIGTERM/SIGINT); `shutdown()` announces `leaving`, drains in-flight work and
stops every task it started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import resource
import time
from collections import Counter
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from shoal.config import RunConfig, load_run_config, load_run_source
from shoal.device import DeviceError, autocast_dtype, choose_device, describe, peak_memory_bytes, resident_bytes
from shoal.dht.identity import load_identity
from shoal.dht.records import MAX_RECORD_NUMBER
from shoal.dht.runs import PublishedRun, collision_report
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.files import atomic_write
from shoal.logs import printable
from shoal.model.checkpoint import Checkpoint, verify
from shoal.node import capacity
from shoal.node.config import NodeConfig
from shoal.node.context import NodeContext
from shoal.node.engine import Engine, Handler, Progress
from shoal.node.hooks import Faults, Hooks
from shoal.node.metrics import MetricsServer, serve_node_metrics
from shoal.p2p import reachability
from shoal.p2p.health import HealthService
from shoal.p2p.links import LinkMonitor
from shoal.node.service import EngineService
from shoal.p2p.reachability import ReachService
from shoal.p2p.restarts import RestartWatch
from shoal.p2p.suspects import Suspects, watch_peers
from shoal.p2p.transport import WIRE_BYTES, call, serve, unserve
from shoal.node.pipeline.data.driver import DataDriver
from shoal.node.pipeline.worker.stage import StageWorker
from shoal.node.rollout.worker import RolloutWorker
from shoal.node.state.keeper import Holder, StateKeeper
from shoal.planning.assignment import Candidate
from shoal.planning.costs import CostModel
from shoal.planning.memory import fits, gib, policy_memory
from shoal.planning.memory import refusal as memory_refusal
from shoal.planning.observed import observed_view
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.swarm_view import (
    ROLE_DATA,
    ROLE_ROLLOUT,
    ROLE_WORKER,
    STATE_ACTIVE,
    STATE_JOINING,
    STATE_LEAVING,
    SwarmView,
)
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

RUN_LOOKUP_ATTEMPTS = 5
SETTLE_ROUNDS = 3
JOIN_PING_TIMEOUT_S = 3.0
MEMORY_SAMPLE_S = 2.0
MAX_MEMORY_SAMPLES = 4000


async def resolve_run(dht: SwarmDHT, config: NodeConfig) -> RunConfig:
    """The run to join: a file, a name published in the swarm, the swarm's default, or the bundled one."""
    published_run = False
    if config.run.run_config_path:
        run = load_run_config(config.run.run_config_path)
        await dht.read_runs(run.name)  # learn the run's claim, if published, to keep it alive (republish_run)
    else:
        name, _, pinned = (config.run.run_name or "").partition("@")
        published: list[PublishedRun] = []
        for attempt in range(RUN_LOOKUP_ATTEMPTS):
            published = [p for p in await dht.read_runs(name or None) if p.config.run_id.startswith(pinned)]
            if published or not name:
                break
            await asyncio.sleep(0.5 * (attempt + 1))
        report = collision_report(published, name or None)  # several runs under one name: the first claim
        if report:
            logger.warning("[%s] %s", dht.peer_id[-8:], report)
        if published:
            run, published_run = published[0].config, True
        elif name:
            raise UsageError(f"no run named {config.run.run_name!r} is published in this swarm "
                             f"({await published_names(dht, config)})")  # fmt: skip
        else:
            run = load_run_config("tiny")
            logger.info("[%s] the swarm publishes no default run; using the bundled %r", dht.peer_id[-8:], run.name)
    if config.run.data_path:
        from shoal.train.data import with_local_data

        if published_run and not run.data.digest:
            raise UsageError(
                f"--data: run {run.name!r} names no data digest (it trains each machine's default corpus), "
                "so this data cannot be checked against it"
            )
        run = await asyncio.to_thread(with_local_data, run, config.run.data_path)
    return run


async def published_names(dht: SwarmDHT, config: NodeConfig) -> str:
    """What a node looking for a run it did not find is told is there: the swarm's default run, and the
    runs its swarm document lists (the DHT cannot list the names published under it)."""
    default = sorted({f"{p.config.name}@{p.config.run_id}" for p in await dht.read_runs(None)})
    said = [f"its default run: {', '.join(default)}" if default else "it publishes no default run"]
    if config.network.swarm:
        from shoal.dht.swarms import resolve_swarm

        listed = resolve_swarm(config.network.swarm, config.network.swarm_files).runs
        said.append(f"swarm {config.network.swarm} lists: {', '.join(listed) or 'none'}")
    return "; ".join(said)


def run_checkpoint(run: RunConfig, config: NodeConfig) -> Checkpoint | None:
    """This machine's copy of the checkpoint the run starts from (--checkpoint, or the run file's
    `[model] from`), verified against the run's digests; None where the run has none or it is not here."""
    folder = config.run.checkpoint_dir
    if run.grpo is not None and run.grpo.policy_checkpoint:
        return policy_checkpoint(run, config)
    if not run.model.checkpoint:
        if folder:
            raise UsageError(f"--checkpoint: run {run.name} starts from no checkpoint")
        return None
    if folder is None and config.run.run_config_path:
        folder = load_run_source(config.run.run_config_path).checkpoint_dir
    return verify(folder, run.model) if folder is not None else None


def policy_checkpoint(run: RunConfig, config: NodeConfig) -> Checkpoint | None:
    """The checkpoint this node's rollouts post-train: the run's (`[grpo.policy] from`), or another in
    the run's tokenizer (`--checkpoint DIR`: this node's own policy choice, as --width is); None where
    this machine has neither (a rollout worker then refuses to start)."""
    from shoal.model.checkpoint import CheckpointError, read_checkpoint

    assert run.grpo is not None
    folder = config.run.checkpoint_dir
    if folder is None and config.run.run_config_path:
        folder = load_run_source(config.run.run_config_path).checkpoint_dir
    if folder is None:
        return None
    checkpoint = read_checkpoint(folder)
    if checkpoint.model.tokenizer != run.grpo.policy_tokenizer:
        raise CheckpointError(f"checkpoint {folder}: its tokenizer.json ({checkpoint.model.tokenizer[:12]}) is "
                              f"not the run's ({run.grpo.policy_tokenizer[:12]}); every bundle is in it")  # fmt: skip
    return checkpoint


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


def published_number(value: float | None, cap: float = MAX_RECORD_NUMBER) -> float | None:
    """A measurement as a record may carry it: None when unknown or not finite, capped at `cap`."""
    if value is None or not math.isfinite(value):
        return None
    return min(max(float(value), 0.0), cap)


class Node:
    def __init__(
        self,
        config: NodeConfig,
        dht: SwarmDHT,
        run: RunConfig,
        block_throughput: float,
        device: torch.device | None = None,
    ):
        self.config, self.dht, self.run = config, dht, run
        self.block_throughput = block_throughput
        self.device = device or torch.device("cpu")
        self.compute_dtype = autocast_dtype(self.device, run.pipeline.compute_dtype)
        self.device_info = describe(self.device)
        # the memory this node plans its stage in: its device's free memory at start, or --memory-limit
        self.memory_bytes = capacity.memory_for_stages(self.device_info, config.limits.memory_limit_gib)
        self.placement_note: str | None = None  # why memory kept this node off the stage it would have taken
        self.client_only = False  # nobody could dial it back: it holds the data role, which dials out only
        self.started_at = float(get_dht_time())
        self.state = STATE_JOINING
        self.stage: int | None = None
        self.max_inflight = 1
        self.view: SwarmView | None = None  # the last view read, without the suspects
        self.raw_view: SwarmView | None = None  # ... and with them
        self.suspects = Suspects(on_change=self._suspects_changed)
        self.router = PeerRouter(routing_policy(config, run), run_cost_model(run), seed=dht.peer_id)
        self.links = LinkMonitor(dht.p2p, dht.peer_id)
        self.hooks = node_hooks(config)
        self.engine: Engine | None = None
        self.memory_samples: list[tuple[float, int]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._handlers: list[str] = []
        self._maddrs: list[str] = []
        self.checkpoint: Checkpoint | None = None  # the run's checkpoint on this machine (run_checkpoint)
        self.keeper: StateKeeper | None = None  # --state-dir: saves this node's state, resumes from it
        self.restarts = RestartWatch()
        self.reachable: bool | None = None  # the reachability self-check's verdict (None: not checked yet)
        self.errors: Counter[str] = Counter()  # by kind, for the metrics (see metrics.ERROR_KINDS)
        self.metrics: MetricsServer | None = None

    @classmethod
    async def create(cls, config: NodeConfig, device: torch.device | None = None) -> Node:
        """`device`: where it computes, already chosen (`shoal node` chooses before it starts anything);
        by default the one `--device` names."""
        if device is None:
            try:
                device = choose_device(config.limits.device)
            except DeviceError as e:
                raise UsageError(str(e)) from None
        keeper = StateKeeper.open(config.state.state_dir, config.state.save_every_s) if config.state.state_dir else None
        identity = load_identity(config.identity_file)
        dht = await SwarmDHT.create(
            identity,
            config.network.initial_peers,
            config.network.host_maddrs,
            config.network.announce_maddrs,
            use_relay=config.network.use_relay,
            use_auto_relay=config.network.use_auto_relay,
            join_timeout_s=config.network.join_timeout_s,
        )
        metrics: MetricsServer | None = None
        try:
            run = await resolve_run(dht, config)
            logger.info("[%s] run %s (%s): %s", dht.peer_id[-8:], run.name, run.run_id, run.to_json())
            if keeper is not None:
                keeper.load(run, dht.peer_id)  # a corrupt or foreign state is refused before anything starts
            if (config.placement.role == "rollout") != (run.mode == "grpo") and config.placement.role != "auto":
                raise UsageError(f"--role {config.placement.role}: run {run.name} is a {run.mode} run")
            loop = asyncio.get_running_loop()
            throughput = (
                0.0  # a rollout worker holds no stage: nothing to measure
                if run.mode == "grpo"
                else await loop.run_in_executor(None, partial(capacity.measure_block_throughput, run, device=device))
            )
            checkpoint = await loop.run_in_executor(None, run_checkpoint, run, config)
            node = cls(config, dht, run, throughput, device)
            logger.info("[%s] %s", node.short_id, node.describe_device())
            node.checkpoint = checkpoint
            node.keeper = keeper
            node.metrics = metrics = await serve_node_metrics(node)
            await node._start()
        except BaseException:
            if metrics is not None:
                await metrics.shutdown()
            await dht.shutdown()
            raise
        return node

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    @property
    def role(self) -> str:
        if self.run.mode == "grpo":
            return ROLE_ROLLOUT
        return ROLE_DATA if self.stage == 0 else ROLE_WORKER

    def choose_stage(self) -> int:
        """The stage to hold now: the one given by --stage, else the swarm's choice among the stages that
        fit this node's memory (none: 0, for rollouts)."""
        if self.role == ROLE_ROLLOUT:
            return 0
        fitting = self.stages_that_fit()
        if self.client_only:
            if 0 not in fitting:
                raise UsageError(f"not reachable, so it can take only the data role, and {self._refusal(0)}")
            return 0
        if self.config.placement.stage is not None:
            stage = self.config.placement.stage
            if stage >= self.run.pipeline.stages:
                last = self.run.pipeline.stages - 1
                raise UsageError(f"--stage {stage}: run {self.run.name} has block stages 1..{last}")
            if stage not in fitting:
                raise UsageError(f"--stage {stage}: {self._refusal(stage)}")
            return stage
        assert self.view is not None
        blocks = max(1, self.view.blocks_per_stage[1]) if self.view.stages > 1 else 1
        forward_s = blocks / max(self.block_throughput, 1e-9) / (1.0 + self.router.cost.backward_factor)
        if fitting == self._stages_for_role():  # memory rules nothing out: the swarm's choice, unchanged
            self.placement_note = None
            return self.router.place(self.view, self.candidate(), forward_s, self.max_inflight)
        chosen = self.router.place(self.view, self.candidate(fitting), forward_s, self.max_inflight)
        wanted = self.router.place(self.view, self.candidate(), forward_s, self.max_inflight)
        note = f"{self._refusal(wanted)}: taking stage {chosen}" if wanted not in fitting else None
        if note is not None and note != self.placement_note:
            logger.warning("[%s] %s", self.short_id, note)
        self.placement_note = note
        return chosen

    def stages_that_fit(self) -> frozenset[int]:
        """The stages this node's memory holds (with --max-inflight microbatches, else one), or exit 2
        naming the smallest one's need when none does."""
        inflight = self.config.limits.max_inflight or 1
        candidates = sorted(self._stages_for_role())
        need = {s: capacity.stage_need(self.run, s) for s in candidates}
        fitting = frozenset(s for s in candidates if fits(need[s], self.memory_bytes, inflight))
        if not fitting:
            smallest = min(candidates, key=lambda s: need[s].total(inflight))
            limited = "" if self.config.limits.memory_limit_gib is None else " (--memory-limit)"
            raise UsageError(f"no stage of run {self.run.name} fits this node: {self._refusal(smallest)}{limited}")
        return fitting

    def _stages_for_role(self) -> frozenset[int]:
        """The stages `--role` lets this node take: 0 for a data node, the block stages for a worker."""
        role = self.config.placement.role
        if role == ROLE_DATA:
            return frozenset({0})
        return frozenset(range(1 if role == ROLE_WORKER else 0, self.run.pipeline.stages))

    def _refusal(self, stage: int) -> str:
        return memory_refusal(capacity.stage_need(self.run, stage), self.memory_bytes)

    def _placement_seen(self) -> str:
        """What a stage choice rested on, for the log: this node's speed and the holders it saw."""
        seen = f"own speed {self.block_throughput:.1f} blocks/s"
        if self.view is None or self.view.stages < 2:
            return seen
        view = self.view
        me = self.peer_id
        speeds = {s: [f"{n.block_throughput:.1f}" for n in view.replicas(s, me)] for s in range(1, view.stages)}
        holders = ", ".join(f"stage {s}: {' '.join(v) or 'none'}" for s, v in speeds.items())
        return f"{seen}; others seen, by speed: {holders}"

    def context(self) -> NodeContext:
        """What an engine built now gets of this node (context.py)."""
        return NodeContext(
            peer_id=self.peer_id,
            run=self.run,
            config=self.config,
            p2p=self.dht.p2p,
            router=self.router,
            links=self.links,
            started_at=self.started_at,
            max_inflight=self.max_inflight,
            current_view=lambda: self.view,
            read_view=self.refresh_view,
            publish=self.publish,
            hooks=self.hooks,
            checkpoint=self.checkpoint,
            suspects=self.suspects,
            device=self.device,
            compute_dtype=self.compute_dtype,
        )

    def progress(self) -> Progress:
        """What the engine reports of its work (an empty record before there is one)."""
        return self.engine.progress() if self.engine is not None else Progress()

    def holder(self) -> Holder:
        return Holder(self.run, self.peer_id, int(self.stage or 0), self.role)

    def current(self) -> tuple[Engine | None, Holder]:
        return self.engine, self.holder()

    def handlers(self) -> Mapping[str, Handler]:
        return self.engine.handlers() if self.engine is not None else {}

    def candidate(self, fitting: frozenset[int] | None = None) -> Candidate:
        return Candidate(
            peer_id=self.peer_id,
            block_throughput=self.block_throughput,
            started_at=self.started_at,
            role=self.config.placement.role,
            current_stage=self.stage,
            stages_that_fit=fitting,
        )

    def record(self) -> dict:
        """This node's DHT record. Numbers that went non-finite or huge (a diverged loss, a poisoned
        gradient norm) are published as unknown or capped: a record that fails the schema would expire
        and silently take the node out of the swarm."""
        progress = self.progress()
        return {
            "kind": "node",
            "run_id": self.run.run_id,
            "peer_id": self.peer_id,
            "maddrs": self._maddrs,
            "role": self.role,
            "stage": int(self.stage or 0),
            "state": self.state,
            "block_throughput": float(self.block_throughput),
            "max_inflight": int(self.max_inflight),
            "inner_step": int(progress.inner_step),
            "outer_epoch": int(progress.outer_epoch),
            "loss": published_number(progress.loss),
            "grad_norm": published_number(progress.grad_norm),
            "grad_norm_clipped": published_number(progress.grad_norm_clipped),
            "protocol_version": PROTOCOL_VERSION,
            "started_at": self.started_at,
            "updated_at": float(get_dht_time()),
            "waiting_for": [int(s) for s in progress.waiting_for],
            "links": self.links.advertised(),
            "replica_distance": published_number(progress.replica_distance),
            "averager_maddrs": list(progress.averager_maddrs),
            "repair": progress.repair.as_record() if progress.repair is not None else None,
            "model_id": progress.model_id,
            "reachable": self.reachable,
            "excluded": list(progress.excluded),  # [{peer_id, reason}], bounded by the engine
            "device": self.device_record(),
            "placement_note": self.placement_note,
        }

    def describe_device(self) -> str:
        """One line on where this node computes, for its log at start."""
        info = self.device_info
        precision = "bf16 autocast" if self.compute_dtype == torch.bfloat16 else "float32"
        limit = "" if self.config.limits.memory_limit_gib is None else f", --memory-limit {gib(self.memory_bytes)}"
        speed = capacity.tokens_per_s(self.run, self.block_throughput)
        return (f"computing on {self.device} ({info.name}: {gib(info.total_bytes)}, {gib(info.free_bytes)} free"
                f"{limit}) in {precision}, {speed:,.0f} tokens/s through a block")  # fmt: skip

    def device_record(self) -> dict:
        """Where this node computes, with its memory now (the accelerator's; the host's on the CPU) and
        its measured speed there."""
        info = describe(self.device)
        return {
            "kind": info.kind,
            "name": printable(info.name, 80) or info.kind,
            "total_bytes": int(info.total_bytes),
            "free_bytes": int(min(info.free_bytes, info.total_bytes)),
            "planned_bytes": int(self.memory_bytes),
            "tokens_per_s": float(published_number(capacity.tokens_per_s(self.run, self.block_throughput)) or 0.0),
            "compute_dtype": "bfloat16" if self.compute_dtype == torch.bfloat16 else "float32",
        }

    async def publish(self) -> bool:
        stored = await self.dht.publish_node(self.record(), self.config.network.record_ttl_s)
        if not stored:
            logger.warning("[%s] node record was not stored by any peer", self.short_id)
        await self.dht.republish_run(
            self.run.run_id, self.config.network.record_ttl_s
        )  # the run outlives its publisher
        return stored

    def _set_stage(self, stage: int) -> None:
        if stage != self.stage:
            logger.info("[%s] takes stage %d (%s)", self.short_id, stage, self._placement_seen())
        self.stage = stage
        budget = capacity.inflight_budget(self.run, stage, self.memory_bytes)
        self.max_inflight = self.config.limits.max_inflight or budget

    async def _start(self) -> None:
        self._maddrs = await self.dht.visible_maddrs()
        watcher = watch_peers(self.dht.p2p, self.suspects, self._listed_peers, self._stop, self._pings)
        self._tasks.append(asyncio.create_task(watcher, name="watch peers"))
        health = HealthService(lambda: (self.state, self.stage))
        services = (health, ReachService(), EngineService(self.handlers, heard=self.suspects.clear))
        for service in services:
            self._handlers += await serve(
                self.dht.p2p, service, self.config.network.rpc_timeout_s, self.errors, self.short_id
            )
        if self.role == ROLE_ROLLOUT:
            await self._start_rollouts()
            return
        # Join: claim a stage, let simultaneous joiners see each other, settle ties by seniority.
        self.view = await self.answering_view()
        await self.check_reachability()
        self._take_client_role_if_unreachable()
        self.stage = self.keeper.saved_stage if self.keeper is not None else None  # resume there if still needed
        self._set_stage(self.choose_stage())
        for _ in range(SETTLE_ROUNDS):
            await self.publish()
            await asyncio.sleep(min(1.0, self.config.heartbeat_s))
            self.view = await self.answering_view()
            chosen = self.choose_stage()
            if chosen == self.stage:
                break
            self._set_stage(chosen)
        await self._build_engine()
        self.state = STATE_ACTIVE
        await self.publish()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self._sample_memory(), name="memory"))
        if self.keeper is not None:
            self._tasks.append(asyncio.create_task(self.keeper.run(self.current), name="save state"))
        if self.stage == 0:
            self._tasks.append(asyncio.create_task(self._run_engine(self.engine), name="train"))
        self._write_ready_file()
        logger.info("[%s] active: %s on stage %d", self.short_id, self.role, self.stage)

    def _take_client_role_if_unreachable(self) -> None:
        """A node nobody could dial back takes the data role: it opens every stream itself (a hop's answer
        comes back over the connection it dialed), where a stage worker waits to be dialed. With
        --use-auto-relay it keeps the swarm's choice, to be reached through a relay."""
        if self.reachable is not False:
            return
        if self.config.network.use_auto_relay:
            logger.warning("[%s] not reachable directly: taking the swarm's choice of stage, to be reached through "
                           "a circuit relay (--use-auto-relay)", self.short_id)  # fmt: skip
            return
        placement = self.config.placement
        if placement.role == ROLE_WORKER or placement.stage is not None:
            flag = "--role worker" if placement.role == ROLE_WORKER else f"--stage {placement.stage}"
            raise UsageError(f"{flag}: peers could not open a connection to this node, and a stage worker must be "
                             "dialed by its peers; forward its port (see the warning above), pass --use-auto-relay, "
                             "or let it take the data role (--role auto)")  # fmt: skip
        logger.warning("[%s] not reachable: taking the data role, which dials every peer itself and needs no "
                       "inbound connection (a stage worker would never be sent work)", self.short_id)  # fmt: skip
        self.client_only = True

    async def _start_rollouts(self) -> None:
        """GRPO: no stage to claim; warm the policy up, announce it, and run the rounds."""
        from shoal.grpo.policy import CheckpointPolicySpec, PolicySpec, check_policy_checkpoint
        from shoal.model.corpus import cache_dir

        assert self.run.grpo is not None
        p = self.config.policy
        if self.run.grpo.policy_checkpoint and self.checkpoint is None:
            raise UsageError(f"run {self.run.name} post-trains a checkpoint (grpo.policy.from): give --checkpoint DIR")
        if self.checkpoint is not None:
            spec = CheckpointPolicySpec(self.run.grpo.task, self.checkpoint, seed=p.seed, warmup_steps=p.warmup_steps)
            try:
                check_policy_checkpoint(spec)
            except ValueError as e:
                raise UsageError(f"checkpoint {self.checkpoint.path}: {e}") from None
            own = "the run's" if self.checkpoint.model.checkpoint == self.run.grpo.policy_checkpoint else "its own"
            logger.info("[%s] post-training %s checkpoint %s (weights %s)", self.short_id, own, self.checkpoint.path,
                        self.checkpoint.model.checkpoint[:12])  # fmt: skip
        else:
            spec = PolicySpec(task=self.run.grpo.task, d_model=p.width, n_layers=p.depth, n_heads=p.heads,
                              seed=p.seed, warmup_steps=p.warmup_steps)  # fmt: skip
        g = self.run.grpo
        rows = g.prompts_per_round * g.group_size * (1 + g.max_peers)  # its own samples and its peers' at most
        need = policy_memory(spec.model_config(), rows, spec.model_config().max_seq_len)
        if not fits(need, self.memory_bytes):
            limited = "" if self.config.limits.memory_limit_gib is None else " (--memory-limit)"
            raise UsageError(f"{memory_refusal(need, self.memory_bytes)}{limited}")
        worker = RolloutWorker(self.context(), spec, Path(p.cache) if p.cache else cache_dir() / "grpo")
        await worker.start()
        self.stage, self.engine = 0, worker
        self.view = await self.answering_view()
        await self.check_reachability()
        self.state = STATE_ACTIVE
        await self.publish()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self._sample_memory(), name="memory"))
        self._tasks.append(asyncio.create_task(self._run_engine(worker), name="rounds"))
        self._write_ready_file()
        logger.info("[%s] active: rollout worker with policy %s", self.short_id, worker.model_id)

    async def check_reachability(self) -> None:
        """Ask the initial peers and a few live nodes to dial us back; when none could, say so once
        with the fix (reachability.py). The verdict goes in our record, so `shoal status` shows it."""
        initial = [m.rsplit("/p2p/", 1)[1] for m in self.config.network.initial_peers if "/p2p/" in m]
        live = [n.peer_id for n in self.view.live_nodes()] if self.view is not None else []
        askers = list(dict.fromkeys(p for p in [*initial, *random.sample(live, len(live))] if p != self.peer_id))
        if not askers:
            return
        result = await reachability.check(self.dht.p2p, self._maddrs, askers)
        if self.config.experiment.unreachable:
            result = dataclasses.replace(result, reachable=False, confirmed=())
        self.reachable = result.reachable
        if result.reachable is False:
            logger.warning("[%s] not reachable: %s", self.short_id, reachability.advice(self._maddrs, result))
        elif result.reachable:
            logger.info("[%s] reachable at %s (%d peer(s) asked)", self.short_id, ", ".join(result.confirmed),
                        result.asked)  # fmt: skip

    async def answering_view(self) -> SwarmView:
        """The swarm view without the peers that do not answer a ping. A killed peer's record lives on
        until its TTL runs out; a joiner that believed it would skip the stage that peer left short."""
        view = await self.dht.read_view(self.run)
        others = [n.peer_id for n in view.nodes if n.peer_id != self.peer_id]
        answers = await asyncio.gather(*(self._answers(peer) for peer in others))
        silent = [peer for peer, ok in zip(others, answers, strict=True) if not ok]
        if silent:
            logger.info(
                "[%s] %d listed peer(s) do not answer: %s", self.short_id, len(silent), [p[-8:] for p in silent]
            )
        for peer in silent:
            self.suspects.mark(peer, "no answer to a ping at join")
        return self.observe_view(view)

    def observe_view(self, view: SwarmView) -> SwarmView:
        """Take a fresh view: routing re-plans over it without the suspects (net/suspects.py), with the
        links measured so far and, at a data node, the throughput its microbatches' trips showed
        (planning/observed.py: claims are only lowered)."""
        self.raw_view = view
        self.suspects.keep_only({n.peer_id for n in view.nodes})
        self._note_restarts(view)
        return self._take_view(view)

    def _take_view(self, raw: SwarmView) -> SwarmView:
        view = raw.without(self.suspects.current()) if len(self.suspects) else raw
        self.view = view
        links = {**view.measured_links(), **self.links.measured()}
        trips = list(self.engine.trips()) if self.engine is not None else []
        routed = observed_view(view, trips, self.router.cost.backward_factor) if trips else view
        self.router.update(Snapshot(routed, self.peer_id, links))
        return view

    def _suspects_changed(self) -> None:
        """A peer failed us or answered again: our choices change now, not at the next heartbeat, and
        the engine acts on what went through a suspect (a data node re-sends or recovers it) now."""
        if self.raw_view is not None:
            view = self._take_view(self.raw_view)
            if self.engine is not None:
                self.engine.on_view(view)

    def _listed_peers(self) -> set[str]:
        view = self.raw_view
        return {n.peer_id for n in view.nodes if n.peer_id != self.peer_id} if view is not None else set()

    async def _pings(self, peer_id: str) -> bool:
        return await self.links.ping(peer_id) is not None

    def _note_restarts(self, view: SwarmView) -> None:
        """Peers back under the same peer id lost what they held: act on it as if they had left."""
        restarted = self.restarts.restarted(view)
        if restarted and self.engine is not None:
            logger.info("[%s] peer(s) restarted: %s", self.short_id, sorted(p[-8:] for p in restarted))
            self.engine.on_peer_restarted(restarted, {n.peer_id for n in view.live_nodes()})

    async def refresh_view(self) -> SwarmView:
        return self.observe_view(await self.dht.read_view(self.run))

    async def _answers(self, peer_id: str) -> bool:
        try:
            await call(
                self.dht.p2p,
                peer_id,
                "rpc_ping",
                Ping(sent_at=time.time(), nonce=0),
                Pong,
                timeout_s=JOIN_PING_TIMEOUT_S,
            )
            return True
        except Exception:
            return False

    async def _build_engine(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        if self.stage == 0:
            shard, shards = self.config.placement.data_shard
            driver = DataDriver(self.context(), shard, shards, self.config.output.progress_file)
            await driver.start()
            self.engine = driver
            if not await self._resume(driver):
                await driver.join_by_copy()  # stage 0 of a run that averages it: the data nodes' current one
        else:
            worker = StageWorker(self.context(), self.stage)
            self.engine = worker
            resumed = await self._resume(worker)  # whose weights: our own saved ones, or a replica's copied
            source = self.peer_id if resumed else await worker.join_by_copy()  # before we announce ourselves active
            listed = self.raw_view.replicas(self.stage, exclude=self.peer_id) if self.raw_view is not None else []
            silent = {n.peer_id for n in listed if n.state == STATE_ACTIVE and n.peer_id in self.suspects}
            if source is None and await worker.repair_if_lost(silent) is None:
                if self.run.model.checkpoint and self.checkpoint is None:
                    raise UsageError(f"run {self.run.name} starts from a checkpoint, and no live replica of stage "
                                     f"{self.stage} gave its weights: give --checkpoint DIR")  # fmt: skip
                if worker.failed_donors or silent:
                    logger.info("[%s] stage %d: no listed replica gave its weights, and the run has not stepped "
                                "yet: starting %s, as every replica did", self.short_id, self.stage,
                                "from the checkpoint" if self.checkpoint else "from the initialisation")  # fmt: skip
            await worker.start()

    async def _resume(self, engine: Engine) -> bool:
        """--state-dir: take this node's saved state for its stage (or a live replica's, if that
        trained further); whether the engine now holds trained weights from either."""
        return self.keeper is not None and await self.keeper.resume(engine, self.holder(), self.view)

    async def _run_engine(self, engine: Engine) -> None:
        try:
            summary = await engine.work()
            logger.info("[%s] training done: %s", self.short_id, summary)
        except Exception:
            self.errors["training"] += 1
            logger.exception("[%s] training failed", self.short_id)
            raise

    async def _sample_memory(self) -> None:
        while not self._stop.is_set():
            self.memory_samples.append((time.monotonic(), resident_bytes()))
            del self.memory_samples[:-MAX_MEMORY_SAMPLES]
            await asyncio.sleep(MEMORY_SAMPLE_S)

    def _write_ready_file(self) -> None:
        if not self.config.output.ready_file:
            return
        atomic_write(
            self.config.output.ready_file,
            json.dumps(
                {
                    "peer_id": self.peer_id,
                    "maddrs": self._maddrs,
                    "stage": self.stage,
                    "role": self.role,
                    "run_id": self.run.run_id,
                    "pid": os.getpid(),
                    "metrics_port": self.metrics.port if self.metrics is not None else None,
                }
            ),
        )

    async def _heartbeat(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.heartbeat_s)
                break
            except TimeoutError:
                pass
            try:
                await self.refresh_view()
                live = [n.peer_id for n in self.raw_view.live_nodes()] if self.raw_view is not None else []
                self.links.forget(set(live))
                for peer in await self.links.ping_round(live, preferred=set()):
                    self.suspects.mark(peer, "no answer to a ping")
                if self.engine is not None:
                    self.engine.on_view(self.view)
                chosen = self.choose_stage()
                if chosen != self.stage and self.can_move():
                    self._set_stage(chosen)
                    await self._build_engine()
                    self._write_ready_file()  # launchers read a node's stage from it
                await self.publish()
            except Exception:
                self.errors["heartbeat"] += 1
                logger.exception("[%s] heartbeat failed", self.short_id)

    def can_move(self) -> bool:
        """Whether this node may change stage now: only before it holds trained state or in-flight
        work (a trained stage moves by copying a live replica, which joining nodes do, not by rebuild)."""
        engine = self.engine
        if engine is None:
            return True
        return self.progress().inner_step == 0 and engine.movable

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def drain(self, deadline: float) -> None:
        """Wait for in-flight work to finish, until `deadline` (monotonic seconds)."""
        while self.engine is not None and self.engine.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def stats(self) -> dict:
        engine = self.engine
        samples = self.memory_samples
        progress = self.progress()
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "stage": self.stage,
            "inner_step": progress.inner_step,
            "loss": progress.loss,
            "block_throughput": self.block_throughput,
            "max_inflight": self.max_inflight,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device": str(self.device),
            "device_peak_bytes": peak_memory_bytes(self.device),  # torch's on an accelerator, the RSS peak on a CPU
            "rss_samples": [[round(t - samples[0][0], 2), rss] for t, rss in samples] if samples else [],
            "traffic": engine.traffic_counts() if engine else {},
            "wire_bytes": WIRE_BYTES.counts(),  # sent, by kind (p2p/transport.py)
            "engine": engine.stats() if engine else {},
        }

    def _write_stats_file(self) -> None:
        if not self.config.output.stats_file:
            return
        atomic_write(self.config.output.stats_file, json.dumps(self.stats(), indent=1))

    async def shutdown(self) -> None:
        started = time.monotonic()
        self._stop.set()
        self.state = STATE_LEAVING
        try:
            await asyncio.wait_for(self.publish(), self.config.limits.drain_timeout_s)
        except Exception as e:
            logger.info("[%s] could not announce leaving: %s", self.short_id, e)
        await self.drain(started + self.config.limits.drain_timeout_s)
        try:
            self._write_stats_file()
        except Exception:
            logger.exception("[%s] could not write the stats file", self.short_id)
        if self.keeper is not None:
            await self.keeper.close(self.current)  # the last save, after the drain: nothing is in flight any more
        if self.engine is not None:
            await self.engine.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await unserve(self.dht.p2p, self._handlers)
        if self.metrics is not None:
            await self.metrics.shutdown()
        await self.dht.shutdown()
        logger.info("[%s] left after %.1f s", self.short_id, time.monotonic() - started)
