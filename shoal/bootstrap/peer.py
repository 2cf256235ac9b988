"""A bootstrap peer: joins (or starts) the DHT, optionally publishes the run config, republishes it.

It holds no model and is not special: once others have joined through it, any peer can stand in
for it, and the swarm keeps working when it is gone (every node of the run republishes the run
record too, under the claim this peer made, so `--run NAME` still resolves).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shoal.config import RunConfig
from shoal.dht.identity import load_identity
from shoal.dht.runs import collision_report
from shoal.dht.swarm import DIRECT, SwarmDHT
from shoal.p2p.health import node_handlers
from shoal.p2p.relay import RelayPlan, limits_for
from shoal.p2p.rpc import serve
from shoal.p2p.services import NodeRpcs
from shoal.p2p.stream_relay import RELAY_STREAM_TIMEOUT_S

if TYPE_CHECKING:
    from shoal.node.metrics import MetricsServer

logger = logging.getLogger(__name__)


class BootstrapPeer:
    def __init__(self, dht: SwarmDHT, run: RunConfig | None, record_ttl_s: float):
        self.dht, self.run, self.record_ttl_s = dht, run, record_ttl_s
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.metrics: MetricsServer | None = None  # set by `shoal bootstrap --metrics-port`

    @classmethod
    async def create(
        cls,
        identity_path: str | None,
        host_maddrs: Sequence[str],
        announce_maddrs: Sequence[str],
        initial_peers: Sequence[str] = (),
        run: RunConfig | None = None,
        record_ttl_s: float = 60.0,
        relay_service: bool = True,
    ) -> BootstrapPeer:
        """`relay_service`: relay for nodes nobody can dial (p2p/relay.py), within limits set from `run`."""
        relaying = RelayPlan(serve=limits_for(run)) if relay_service else DIRECT
        dht = await SwarmDHT.create(
            load_identity(identity_path), initial_peers, host_maddrs, announce_maddrs, relaying=relaying
        )
        # joiners ask it to dial them back; diagnoses ping it
        await serve(dht.transport, NodeRpcs, node_handlers(lambda: ("bootstrap", None)), who=dht.peer_id[-8:])
        if relay_service:  # and carries streams to the nodes behind NAT that hold a slot on it
            await dht.transport.serve_relay(RELAY_STREAM_TIMEOUT_S)
        peer = cls(dht, run, record_ttl_s)
        if run is not None:
            await peer._publish_run()
            await peer._report_collisions()
            peer._tasks.append(asyncio.create_task(peer._republish(), name="republish-run"))
        return peer

    async def _publish_run(self) -> None:
        assert self.run is not None
        if not await self.dht.publish_run(self.run, self.record_ttl_s, as_default=True):
            logger.warning("[%s] run config %s was not stored by any peer yet", self.dht.peer_id[-8:], self.run.run_id)

    async def _report_collisions(self) -> None:
        """Say at once when other runs share this run's name or the swarm's default: joiners take the
        earliest claim (see shoal/dht/runs.py), which may not be this one."""
        assert self.run is not None
        for name in (self.run.name, None):
            report = collision_report(await self.dht.read_runs(name), name)
            if report:
                logger.warning("[%s] %s", self.dht.peer_id[-8:], report)

    async def _republish(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.record_ttl_s / 3)
                return
            except TimeoutError:
                pass
            try:
                await self._publish_run()
            except Exception:
                logger.exception("[%s] republishing the run config failed", self.dht.peer_id[-8:])

    async def maddrs(self) -> list[str]:
        return await self.dht.visible_maddrs()

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.metrics is not None:
            await self.metrics.shutdown()
        await self.dht.shutdown()
