"""The node daemon: join the swarm, announce a signed record, hold a stage, leave cleanly.

Lifecycle: `Node.create()` starts libp2p and the DHT node, resolves the run, measures this
machine, picks a stage, serves RPCs and starts the heartbeat; `run_until_stopped()` serves until
`request_stop()` (SIGTERM/SIGINT); `shutdown()` announces `leaving`, drains in-flight work and
stops every task it started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from shoal.config import RunConfig, load_run_config
from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.model.stages import stage_layers
from shoal.node import capacity
from shoal.node.config import NodeConfig
from shoal.node.health import HealthService
from shoal.node.transport import serve, unserve
from shoal.planning.assignment import Candidate, choose_stage
from shoal.planning.swarm_view import (
    ROLE_DATA,
    ROLE_WORKER,
    STATE_ACTIVE,
    STATE_JOINING,
    STATE_LEAVING,
    SwarmView,
)
from shoal.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

RUN_LOOKUP_ATTEMPTS = 5
SETTLE_ROUNDS = 3


async def resolve_run(dht: SwarmDHT, config: NodeConfig) -> RunConfig:
    """The run to join: a file, a name published in the swarm, the swarm's default, or the bundled one."""
    if config.run_config_path:
        run = load_run_config(config.run_config_path)
    else:
        name, _, pinned = (config.run_name or "").partition("@")
        configs: list[RunConfig] = []
        for attempt in range(RUN_LOOKUP_ATTEMPTS):
            configs = [c for c in await dht.read_runs(name or None) if c.run_id.startswith(pinned)]
            if configs or not name:
                break
            await asyncio.sleep(0.5 * (attempt + 1))
        if len(configs) > 1:
            ids = ", ".join(f"{c.name}@{c.run_id}" for c in configs)
            raise UsageError(f"several runs are published under that name ({ids}); pass --run NAME@RUN_ID")
        if configs:
            run = configs[0]
        elif name:
            raise UsageError(f"no run named {config.run_name!r} is published in this swarm")
        else:
            run = load_run_config("tiny")
            logger.info("the swarm publishes no default run; using the bundled %r", run.name)
    if config.data_path:
        run = run.replace({"data.path": config.data_path})
    return run


class Node:
    def __init__(self, config: NodeConfig, dht: SwarmDHT, run: RunConfig, block_throughput: float):
        self.config, self.dht, self.run = config, dht, run
        self.block_throughput = block_throughput
        self.started_at = float(get_dht_time())
        self.state = STATE_JOINING
        self.stage: int | None = None
        self.max_inflight = 1
        self.inner_step = 0
        self.outer_epoch = 0
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.view: SwarmView | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._handlers: list[str] = []
        self._maddrs: list[str] = []

    @classmethod
    async def create(cls, config: NodeConfig) -> Node:
        identity = load_identity(config.identity)
        dht = await SwarmDHT.create(identity, config.initial_peers, config.host_maddrs, config.announce_maddrs)
        try:
            run = await resolve_run(dht, config)
            logger.info("run %s (%s): %s", run.name, run.run_id, run.to_json())
            throughput = await asyncio.get_running_loop().run_in_executor(
                None, capacity.measure_block_throughput, run
            )
            node = cls(config, dht, run, throughput)
            await node._start()
        except BaseException:
            await dht.shutdown()
            raise
        return node

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def role(self) -> str:
        return ROLE_DATA if self.stage == 0 else ROLE_WORKER

    def candidate(self) -> Candidate:
        return Candidate(peer_id=self.peer_id, block_throughput=self.block_throughput,
                         started_at=self.started_at, role=self.config.role, current_stage=self.stage)

    def record(self) -> dict:
        return {
            "kind": "node", "run_id": self.run.run_id, "peer_id": self.peer_id, "maddrs": self._maddrs,
            "role": self.role, "stage": int(self.stage or 0), "state": self.state,
            "block_throughput": float(self.block_throughput), "max_inflight": int(self.max_inflight),
            "inner_step": int(self.inner_step), "outer_epoch": int(self.outer_epoch),
            "loss": None if self.loss is None else float(self.loss),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "protocol_version": PROTOCOL_VERSION, "started_at": self.started_at,
            "updated_at": float(get_dht_time()),
        }

    async def publish(self) -> bool:
        stored = await self.dht.publish_node(self.record(), self.config.record_ttl_s)
        if not stored:
            logger.warning("[%s] node record was not stored by any peer", self.peer_id[-8:])
        return stored

    def _set_stage(self, stage: int) -> None:
        if stage != self.stage:
            logger.info("[%s] takes stage %d", self.peer_id[-8:], stage)
        self.stage = stage
        blocks = len(stage_layers(self.run.model.n_layers, self.run.pipeline.stages, stage))
        self.max_inflight = self.config.max_inflight or capacity.inflight_budget(self.run, max(1, blocks))

    async def _start(self) -> None:
        self._maddrs = await self.dht.visible_maddrs()
        self._handlers = await serve(self.dht.p2p, HealthService(self), self.config.rpc_timeout_s)
        # Join: claim a stage, let simultaneous joiners see each other, settle ties by seniority.
        self.view = await self.dht.read_view(self.run)
        self._set_stage(choose_stage(self.view, self.candidate()))
        for _ in range(SETTLE_ROUNDS):
            await self.publish()
            await asyncio.sleep(min(1.0, self.config.heartbeat_s))
            self.view = await self.dht.read_view(self.run)
            chosen = choose_stage(self.view, self.candidate())
            if chosen == self.stage:
                break
            self._set_stage(chosen)
        self.state = STATE_ACTIVE
        await self.publish()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        self._write_ready_file()
        logger.info("[%s] active: %s on stage %d", self.peer_id[-8:], self.role, self.stage)

    def _write_ready_file(self) -> None:
        if not self.config.ready_file:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"peer_id": self.peer_id, "maddrs": self._maddrs, "stage": self.stage,
                                   "role": self.role, "run_id": self.run.run_id, "pid": os.getpid()}))
        os.replace(tmp, path)

    async def _heartbeat(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.heartbeat_s)
                break
            except TimeoutError:
                pass
            try:
                self.view = await self.dht.read_view(self.run)
                chosen = choose_stage(self.view, self.candidate())
                if chosen != self.stage and self.can_move():
                    self._set_stage(chosen)
                await self.publish()
            except Exception:
                logger.exception("[%s] heartbeat failed", self.peer_id[-8:])

    def can_move(self) -> bool:
        """Whether this node may change stage now (no in-flight work tied to the current one)."""
        return True

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def drain(self, deadline: float) -> None:
        """Wait for in-flight work to finish, until `deadline` (monotonic seconds)."""

    async def shutdown(self) -> None:
        started = time.monotonic()
        self._stop.set()
        self.state = STATE_LEAVING
        try:
            await asyncio.wait_for(self.publish(), self.config.drain_timeout_s)
        except Exception as e:
            logger.info("[%s] could not announce leaving: %s", self.peer_id[-8:], e)
        await self.drain(started + self.config.drain_timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await unserve(self.dht.p2p, self._handlers)
        await self.dht.shutdown()
        logger.info("[%s] left after %.1f s", self.peer_id[-8:], time.monotonic() - started)
