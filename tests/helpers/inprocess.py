"""A swarm in one event loop: data nodes and stage workers, the real engines, over `MemoryNetwork`.

Every RPC goes as between daemons (framed messages, tensors, the receivers' checks), through the same
`serve` a daemon runs; what is missing is libp2p, the DHT and the processes. The view every node reads
is the harness's: it lists the members alive (less the peers a node suspects, as a daemon's view does),
and every change reaches each node's router and engine as a heartbeat would bring it. `kill` is what a
SIGKILL looks like from the other peers: the member's handlers stop, its streams break, it leaves the
view. Faults are scripted with `network.before_open` (act when one node opens a stream to another).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from types import SimpleNamespace

import torch

from shoal.config import RunConfig
from shoal.device import autocast_dtype
from shoal.dht.records import NodeRecord as RecordSchema
from shoal.dht.records import load_record
from shoal.model.stages import stage_layers
from shoal.node.config import NodeConfig
from shoal.node.context import NodeContext
from shoal.node.engine import Engine
from shoal.node.engines import node_hooks, routing_policy, run_cost_model
from shoal.node.hooks import Hooks
from shoal.node.machine import Machine
from shoal.node.pipeline.data.driver import DataDriver
from shoal.node.pipeline.worker.stage import StageWorker
from shoal.node.record import NodeRecord, Standing
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.links import LinkMonitor
from shoal.p2p.memory import MemoryNetwork
from shoal.p2p.rpc import serve
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.swarm_view import ROLE_DATA, ROLE_WORKER, STATE_ACTIVE, NodeInfo, SwarmView
from shoal.protocol.pipeline import Ack
from tests.helpers.tiny import sample_text

BLOCK_THROUGHPUT = 50.0  # what every member claims: routing weighs them alike
MAX_INFLIGHT = 8
DATA = "QmDataNode0"


def data_id(index: int) -> str:
    return f"QmDataNode{index}"


def worker_id(stage: int, replica: int) -> str:
    return f"QmWorker{stage}r{replica}"


@dataclasses.dataclass
class Member:
    peer_id: str
    stage: int
    ctx: NodeContext
    engine: Engine
    started_at: float
    alive: bool = True
    record_lingers: bool = False  # dead, but its last record still in every view (a TTL after a SIGKILL)

    @property
    def role(self) -> str:
        return ROLE_DATA if self.stage == 0 else ROLE_WORKER


def corpus_run(tmp_path, run: RunConfig) -> RunConfig:
    """`run` reading a corpus file written here: hermetic, as the multi-process tests' runs are."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(sample_text(30000))
    return run.replace({"data.path": str(corpus)})


class InProcessSwarm:
    def __init__(
        self,
        run: RunConfig,
        replicas: dict[int, int],
        config: NodeConfig | None = None,
        hooks: dict[str, Hooks] | None = None,
        data_nodes: int = 1,
    ):
        """`replicas`: stage -> how many workers hold it (named `QmWorker{stage}r{replica}`); `data_nodes`:
        how many data nodes train it, each its own shard of the data (`data_id(k)`; the first is `DATA`);
        `hooks`: a member's faults by name, where a test scripts them in the engine itself."""
        self.run, self.replicas, self.data_nodes = run, replicas, data_nodes
        self.config = config or NodeConfig()
        self.hooks = hooks or {}
        self.network = MemoryNetwork()
        self.members: dict[str, Member] = {}
        self.data: DataDriver | None = None  # the first data node
        self.drivers: list[DataDriver] = []
        self._clock = 0.0

    # ---- the members ---------------------------------------------------------------------------------

    async def start(self, data_config: NodeConfig | None = None) -> DataDriver:
        """Every worker (stage by stage, replica by replica), then the data nodes; returns the first."""
        for stage in range(1, self.run.pipeline.stages):
            for replica in range(self.replicas.get(stage, 1)):
                await self.add_worker(stage, worker_id(stage, replica))
        for k in range(self.data_nodes):
            ctx = self._context(data_id(k), data_config or self.config)
            driver = DataDriver(ctx, shard=k, num_shards=self.data_nodes)
            await driver.start()
            await self._join(Member(data_id(k), 0, ctx, driver, self._started()))
            self.drivers.append(driver)
        self.data = self.drivers[0]
        return self.data

    async def add_worker(self, stage: int, peer_id: str) -> StageWorker:
        ctx = self._context(peer_id, self.config)
        worker = StageWorker(ctx, stage)
        await self._join(Member(peer_id, stage, ctx, worker, self._started()))
        await worker.start()
        return worker

    async def add_joiner(self, stage: int, peer_id: str) -> StageWorker:
        """A worker that joins a running swarm as the daemon's does: it copies its stage (and what the
        replica it copies keeps) before it serves."""
        ctx = self._context(peer_id, self.config)
        worker = StageWorker(ctx, stage)
        await worker.join_by_copy()
        await self._join(Member(peer_id, stage, ctx, worker, self._started()))
        await worker.start()
        return worker

    async def kill(self, peer_id: str, record_lingers: bool = False) -> None:
        """SIGKILL, as its peers see it: nothing it held answers again, and it leaves every view (or,
        `record_lingers`, its last record stays in them, as a DHT keeps it until its TTL runs out)."""
        member = self.members[peer_id]
        member.alive, member.record_lingers = False, record_lingers
        self.network.kill(peer_id)
        self._tell_views()
        await member.engine.stop()

    def kill_soon(self, peer_id: str) -> None:
        """`kill` from inside a hook that cannot await (the kill lands before the stream opens)."""
        member = self.members[peer_id]
        member.alive = False
        self.network.kill(peer_id)
        self._tell_views()
        asyncio.ensure_future(member.engine.stop())

    async def close(self) -> None:
        await asyncio.gather(*(m.engine.stop() for m in self.members.values() if m.alive), return_exceptions=True)

    def workers(self, stage: int) -> list[str]:
        return [m.peer_id for m in self.members.values() if m.stage == stage and m.alive]

    def engine(self, peer_id: str) -> Engine:
        return self.members[peer_id].engine

    def published_record(self, peer_id: str) -> RecordSchema:
        """The record `peer_id`'s daemon would publish now, read back as every peer reads it: raises
        `RecordError` naming the field where peers would refuse it (and the node drop out of the swarm)."""
        member = self.members[peer_id]
        machine = Machine.at_start(self.run, torch.device("cpu"), BLOCK_THROUGHPUT, None)
        record = NodeRecord(SimpleNamespace(peer_id=peer_id), self.run, machine, member.ctx.links, member.started_at,
                            ttl_s=30.0)  # type: ignore[arg-type]  # fmt: skip
        standing = Standing(role=member.role, stage=member.stage, state=STATE_ACTIVE, max_inflight=MAX_INFLIGHT,
                            maddrs=[], reachable=None, relays=(), relay_service=False, placement_note=None)  # fmt: skip
        return load_record(RecordSchema, record.build(standing, member.engine.progress()))

    # ---- what every member sees ----------------------------------------------------------------------

    def view(self, exclude: Iterable[str] = ()) -> SwarmView:
        excluded = set(exclude)
        listed = [m for m in self.members.values() if m.alive or m.record_lingers]
        nodes = tuple(self._record(m) for m in listed if m.peer_id not in excluded)
        stages = self.run.pipeline.stages
        blocks = tuple(len(stage_layers(self.run.model.n_layers, stages, s)) for s in range(stages))
        return SwarmView(self.run.run_id, self.run.pipeline.stages, blocks, nodes=nodes, taken_at=self._clock)

    def _record(self, member: Member) -> NodeInfo:
        progress = member.engine.progress()
        return NodeInfo(member.peer_id, member.role, member.stage, STATE_ACTIVE, BLOCK_THROUGHPUT, MAX_INFLIGHT,
                        inner_step=progress.inner_step, outer_epoch=progress.outer_epoch,
                        started_at=member.started_at, backup=progress.backup)  # fmt: skip

    def _view_of(self, ctx: NodeContext) -> SwarmView:
        return self.view(exclude=ctx.suspects.current())

    def _tell_views(self) -> None:
        for member in self.members.values():
            if member.alive:
                view = self._view_of(member.ctx)
                member.ctx.router.update(Snapshot(view, member.peer_id))
                member.engine.on_view(view)

    async def _join(self, member: Member) -> None:
        self.members[member.peer_id] = member
        refuse = lambda rpc: Ack(accepted=False, reason=rpc.refusal)  # as the daemon answers
        await serve(member.ctx.transport, EngineRpcs, member.engine.handlers, refuse=refuse,
                    who=member.peer_id[-8:], heard=member.ctx.suspects.clear)  # fmt: skip
        self._tell_views()

    def _started(self) -> float:
        self._clock += 1.0
        return self._clock

    def _context(self, peer_id: str, config: NodeConfig) -> NodeContext:
        transport = self.network.transport(peer_id)
        ctx: NodeContext

        async def fresh_view() -> SwarmView:
            return self._view_of(ctx)

        async def publish() -> bool:
            return True

        ctx = NodeContext(
            peer_id=peer_id,
            run=self.run,
            config=config,
            transport=transport,
            router=PeerRouter(routing_policy(config, self.run), run_cost_model(self.run), seed=peer_id),
            links=LinkMonitor(transport, peer_id),
            started_at=0.0,
            max_inflight=MAX_INFLIGHT,
            current_view=lambda: self._view_of(ctx),
            current_listed_view=self.view,
            read_view=fresh_view,
            publish=publish,
            hooks=self.hooks.get(peer_id) or node_hooks(config),
            compute_dtype=autocast_dtype(torch.device("cpu"), self.run.pipeline.compute_dtype),
        )
        ctx.suspects.on_change = self._tell_views
        return ctx
