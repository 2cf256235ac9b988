"""The node daemon: join the swarm, announce a signed record, hold a stage, leave cleanly.

Lifecycle: `Node.create()` starts libp2p and the DHT node, resolves the run (run_source.py), measures
this machine (machine.py), picks a stage (placement.py), builds its role's engine (engines.py), serves
RPCs and starts the heartbeat, which keeps the view (view.py) and publishes the record (record.py);
`run_until_stopped()` serves until `request_stop()` (SIGTERM/SIGINT); `shutdown()` announces
`leaving`, drains in-flight work and stops every task it started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from functools import partial

import torch
from hivemind.utils import get_dht_time

from shoal.config import RunConfig
from shoal.device import DeviceError, choose_device, resident_bytes
from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.files import atomic_write
from shoal.model.checkpoint import Checkpoint
from shoal.node import capacity
from shoal.node.config import NodeConfig
from shoal.node.context import NodeContext
from shoal.node.engine import Engine, Handler, Progress
from shoal.node.engines import ENGINES, EngineSetup, node_hooks, routing_policy, run_cost_model
from shoal.node.machine import Machine
from shoal.node.metrics import MetricsServer, serve_node_metrics
from shoal.node.placement import Placement
from shoal.node.record import NodeRecord, Standing
from shoal.node.relaying import reach_through_relays_if_needed, relay_service_limits
from shoal.node.reports import MemorySampler, node_stats, write_ready_file
from shoal.node.rpcs import EngineRpcs
from shoal.node.run_source import resolve_run, run_checkpoint
from shoal.node.state.keeper import Holder, StateKeeper
from shoal.node.state.peers import PeerMemory, known_peers
from shoal.node.view import ViewKeeper
from shoal.p2p import reachability
from shoal.p2p.health import node_handlers
from shoal.p2p.links import LinkMonitor
from shoal.p2p.relay import RelayPlan, relays_in
from shoal.p2p.rpc import Rpc, serve, unserve
from shoal.p2p.services import NodeRpcs
from shoal.p2p.stream_relay import RELAY_PROTOCOL, RELAYED_PROTOCOL
from shoal.p2p.suspects import watch_peers
from shoal.planning.peer_router import PeerRouter
from shoal.planning.swarm_view import (
    ROLE_DATA,
    ROLE_ROLLOUT,
    ROLE_WORKER,
    STATE_ACTIVE,
    STATE_JOINING,
    STATE_LEAVING,
    SwarmView,
)
from shoal.protocol.pipeline import Ack

logger = logging.getLogger(__name__)

SETTLE_ROUNDS = 3


class Node:
    """One peer of one run. It owns the lifecycle and the state every part reads (its stage, its state,
    its engine); each part gets only what it uses: `Placement` the run, the options and the machine;
    `ViewKeeper` the DHT, the router and a way to reach the engine; `NodeRecord` what it publishes."""

    def __init__(self, config: NodeConfig, dht: SwarmDHT, run: RunConfig, machine: Machine):
        self.config, self.dht, self.run, self.machine = config, dht, run, machine
        self.started_at = float(get_dht_time())
        self.state = STATE_JOINING
        self.stage: int | None = None
        self.max_inflight = 1
        self.router = PeerRouter(routing_policy(config, run), run_cost_model(run), seed=dht.peer_id)
        self.links = LinkMonitor(dht.transport, dht.peer_id)
        self.hooks = node_hooks(config)
        self.engine: Engine | None = None
        self.views = ViewKeeper(dht, run, self.router, self.links, engine=lambda: self.engine)
        self.placement = Placement(
            run, config.placement, config.limits.max_inflight, machine, self.router, dht.peer_id, self.started_at
        )
        self.record = NodeRecord(dht, run, machine, self.links, self.started_at, config.network.record_ttl_s)
        self.memory = MemorySampler()
        # what the process holds before any stage: the interpreter, torch, the libp2p client, the
        # measured block (its stats report the peak beside it, so the stage's own share can be read)
        self.start_rss_bytes = resident_bytes()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._handlers: list[str] = []
        self._maddrs: list[str] = []
        self.checkpoint: Checkpoint | None = None  # the run's checkpoint on this machine (run_checkpoint)
        self.keeper: StateKeeper | None = None  # --state-dir: saves this node's state, resumes from it
        self.peer_memory: PeerMemory | None = None  # --state-dir: the live peers a restart joins through
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
        remembered = known_peers(config.state.state_dir) if config.state.state_dir else ()
        initial_peers = list(dict.fromkeys([*config.network.initial_peers, *remembered]))
        if len(initial_peers) > len(config.network.initial_peers):
            logger.info("joining through %d initial peer(s) and %d more seen live before this restart (%s)",
                        len(config.network.initial_peers), len(initial_peers) - len(config.network.initial_peers),
                        config.state.state_dir)  # fmt: skip
        dht = await SwarmDHT.create(
            identity,
            initial_peers,
            config.network.host_maddrs,
            config.network.announce_maddrs,
            use_relay=config.network.use_relay,
            relaying=RelayPlan(serve=relay_service_limits(config)),
            join_timeout_s=config.network.join_timeout_s,
        )
        metrics: MetricsServer | None = None
        try:
            run = await resolve_run(dht, config)
            dht, reachable = await reach_through_relays_if_needed(dht, identity, initial_peers, config, run)
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
            node = cls(config, dht, run, Machine.at_start(run, device, throughput, config.limits.memory_limit_gib))
            node.reachable = reachable  # checked at start already (None: the stage choice checks)
            logger.info("[%s] %s", node.short_id, node.machine.describe(run))
            node.checkpoint = checkpoint
            node.keeper = keeper
            if config.state.state_dir:
                node.peer_memory = PeerMemory(config.state.state_dir, dht.peer_id, config.state.save_every_s)
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

    @property
    def view(self) -> SwarmView | None:
        """The last view read, without the suspects."""
        return self.views.view

    @property
    def block_throughput(self) -> float:
        return self.machine.block_throughput

    def context(self) -> NodeContext:
        """What an engine built now gets of this node (context.py)."""
        return NodeContext(
            peer_id=self.peer_id,
            run=self.run,
            config=self.config,
            transport=self.dht.transport,
            router=self.router,
            links=self.links,
            started_at=self.started_at,
            max_inflight=self.max_inflight,
            current_view=lambda: self.views.view,
            current_listed_view=lambda: self.views.raw_view,
            read_view=self.views.refresh,
            publish=self.publish,
            hooks=self.hooks,
            checkpoint=self.checkpoint,
            suspects=self.views.suspects,
            device=self.machine.device,
            compute_dtype=self.machine.compute_dtype,
        )

    def progress(self) -> Progress:
        """What the engine reports of its work (an empty record before there is one)."""
        return self.engine.progress() if self.engine is not None else Progress()

    def holder(self) -> Holder:
        return Holder(self.run, self.peer_id, int(self.stage or 0), self.role)

    def current(self) -> tuple[Engine | None, Holder]:
        return self.engine, self.holder()

    def handlers(self) -> Mapping[Rpc, Handler]:
        return self.engine.handlers() if self.engine is not None else {}

    def standing(self) -> Standing:
        return Standing(
            role=self.role,
            stage=self.stage,
            state=self.state,
            max_inflight=self.max_inflight,
            maddrs=self._maddrs,
            reachable=self.reachable,
            relays=relays_in(self._maddrs),
            relay_service=self.config.network.relay_service,
            placement_note=self.placement.note,
        )

    async def publish(self) -> bool:
        return await self.record.publish(self.standing(), self.progress())

    def choose_stage(self) -> int:
        return self.placement.choose_stage(self.view, self.stage, self.max_inflight)

    def _relays_of(self, peer: str) -> tuple[str, ...]:
        """The relays a peer behind NAT is reached through, as its last record read says."""
        view = self.views.raw_view
        listed = next((n for n in view.nodes if n.peer_id == peer), None) if view is not None else None
        return listed.relays if listed is not None else ()

    def _set_stage(self, stage: int) -> None:
        if stage != self.stage:
            logger.info("[%s] takes stage %d (%s)", self.short_id, stage, self.placement.seen(self.view))
        self.stage = stage
        self.max_inflight = self.placement.inflight(stage)

    async def _start(self) -> None:
        self._maddrs = await self.dht.visible_maddrs()
        suspects = self.views.suspects
        watcher = watch_peers(self.dht.transport, suspects, self.views.listed_peers, self._stop, self.views.pings)
        self._tasks.append(asyncio.create_task(watcher, name="watch peers"))
        transport, timeout_s = self.dht.transport, self.config.network.rpc_timeout_s
        transport.relays_of, transport.own_relays = self._relays_of, lambda: relays_in(self._maddrs)
        await transport.serve_relayed(timeout_s)
        self._handlers.append(RELAYED_PROTOCOL)
        if self.config.network.relay_service:
            await transport.serve_relay(timeout_s)
            self._handlers.append(RELAY_PROTOCOL)
        served = dict(timeout_s=timeout_s, errors=self.errors, who=self.short_id)
        own = node_handlers(lambda: (self.state, self.stage))
        self._handlers += await serve(self.dht.transport, NodeRpcs, own, **served)
        # whatever engine runs now; an RPC it does not serve is answered as its declaration says
        refuse = lambda rpc: Ack(accepted=False, reason=rpc.refusal)
        self._handlers += await serve(
            self.dht.transport, EngineRpcs, self.handlers, heard=suspects.clear, refuse=refuse, **served
        )
        if self.role == ROLE_ROLLOUT:
            await self._start_rollouts()
        else:
            await self._start_on_stage()

    async def _start_on_stage(self) -> None:
        """Join: claim a stage, let simultaneous joiners see each other, settle ties by seniority."""
        await self.views.answering_view()
        await self.check_reachability()
        self.placement.take_client_role_if_unreachable(self.reachable, relays_in(self._maddrs))
        self.stage = self.keeper.saved_stage if self.keeper is not None else None  # resume there if still needed
        self._set_stage(self.choose_stage())
        for _ in range(SETTLE_ROUNDS):
            await self.publish()
            await asyncio.sleep(min(1.0, self.config.heartbeat_s))
            await self.views.answering_view()
            chosen = self.choose_stage()
            if chosen == self.stage:
                break
            self._set_stage(chosen)
        await self._build_engine()
        self.state = STATE_ACTIVE
        await self.publish()
        self._start_tasks(save_state=self.keeper is not None)
        self._write_ready_file()
        logger.info("[%s] active: %s on stage %d", self.short_id, self.role, self.stage)

    async def _start_rollouts(self) -> None:
        """GRPO: no stage to claim; warm the policy up, announce it, and run the rounds."""
        await self._build_engine()
        self.stage = 0
        await self.views.answering_view()
        await self.check_reachability()
        self.state = STATE_ACTIVE
        await self.publish()
        self._start_tasks(save_state=False)
        self._write_ready_file()
        logger.info("[%s] active: rollout worker with policy %s", self.short_id, self.progress().model_id)

    def _start_tasks(self, save_state: bool) -> None:
        """The heartbeat, the memory sampler, the saves to --state-dir if asked and, for a role that has
        one, the engine's own loop."""
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self.memory.run(self._stop), name="memory"))
        if save_state and self.keeper is not None:
            self._tasks.append(asyncio.create_task(self.keeper.run(self.current), name="save state"))
        work = ENGINES[self.role].work
        if work is not None and self.engine is not None:
            self._tasks.append(asyncio.create_task(self._run_engine(self.engine), name=work))

    async def check_reachability(self) -> None:
        """Ask the initial peers and a few live nodes to dial us back; when none could, say so once
        with the fix (reachability.py). The verdict goes in our record, so `shoal status` shows it."""
        if self.reachable is not None and not self.config.experiment.unreachable:
            return  # settled at start (relaying.py)
        live = [n.peer_id for n in self.view.live_nodes()] if self.view is not None else []
        askers = reachability.askers(self.config.network.initial_peers, live, self.peer_id)
        if not askers:
            return
        result = await reachability.check(self.dht.transport, self._maddrs, askers)
        if self.config.experiment.unreachable:
            result = dataclasses.replace(result, reachable=False, confirmed=())
        self.reachable = result.reachable
        if result.reachable is False and relays_in(self._maddrs):
            logger.info("[%s] not reachable directly, reached through relay(s) %s", self.short_id,
                        ", ".join(r[-8:] for r in relays_in(self._maddrs)))  # fmt: skip
        elif result.reachable is False:
            logger.warning("[%s] not reachable: %s", self.short_id, reachability.advice(self._maddrs, result))
        elif result.reachable:
            logger.info("[%s] reachable at %s (%d peer(s) asked)", self.short_id, ", ".join(result.confirmed),
                        result.asked)  # fmt: skip

    async def _build_engine(self) -> None:
        """The engine of this node's role (engines.py), in place of the one it had."""
        if self.engine is not None:
            await self.engine.stop()
        setup = EngineSetup(
            context=self.context(),
            stage=int(self.stage or 0),
            machine=self.machine,
            listed=self.views.raw_view,
            install=self._install,
            resume=self._resume,
        )
        await ENGINES[self.role].start(setup)

    def _install(self, engine: Engine) -> None:
        self.engine = engine

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

    def _write_ready_file(self) -> None:
        port = self.metrics.port if self.metrics is not None else None
        write_ready_file(self.config.output.ready_file, self.peer_id, self._maddrs, self.stage, self.role,
                         self.run.run_id, port)  # fmt: skip

    async def _heartbeat(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.heartbeat_s)
                break
            except TimeoutError:
                pass
            try:
                await self.views.refresh()
                raw = self.views.raw_view
                if self.peer_memory is not None:
                    self.peer_memory.remember(raw)
                live = [n.peer_id for n in raw.live_nodes()] if raw is not None else []
                self.links.forget(set(live))
                for peer in await self.links.ping_round(live, preferred=set()):
                    self.views.suspects.mark(peer, "no answer to a ping")
                if self.engine is not None:
                    self.engine.on_view(self.view)
                chosen = self.choose_stage()
                if chosen != self.stage and self.can_move():
                    self._set_stage(chosen)
                    await self._build_engine()
                    self._write_ready_file()  # launchers read a node's stage from it
                if relays_in(self._maddrs):  # a relay that died is replaced: the addresses change
                    self._maddrs = await self.dht.visible_maddrs(latest=True)
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
        progress = self.progress()
        own = {"peer_id": self.peer_id, "role": self.role, "stage": self.stage, "inner_step": progress.inner_step,
               "loss": progress.loss, "block_throughput": self.block_throughput,
               "max_inflight": self.max_inflight, "start_rss_bytes": self.start_rss_bytes}  # fmt: skip
        return node_stats(own, self.engine, self.machine.device, self.memory)

    def _write_stats_file(self) -> None:
        if self.config.output.stats_file:
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
        await unserve(self.dht.transport, self._handlers)
        if self.metrics is not None:
            await self.metrics.shutdown()
        await self.dht.shutdown()
        logger.info("[%s] left after %.1f s", self.short_id, time.monotonic() - started)
