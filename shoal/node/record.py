"""This node's DHT record: what it tells the swarm of itself every heartbeat (who it is, where it stands,
how far its engine got, the machine it computes on), published with the run's claim kept alive.

Numbers that went non-finite or huge (a diverged loss, a poisoned gradient norm) are published as
unknown or capped: a record that fails the schema would expire and silently take the node out of the
swarm. Counters (`inner_step`, `outer_epoch`) are this node's own, moved only by step numbers its
engine checked (shoal/node/pipeline/worker/step_window.py); a record that still fails its schema is a
bug, said as one, naming the field, and never sent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from hivemind.utils import get_dht_time

from shoal.config import RunConfig
from shoal.device import describe
from shoal.dht.records import MAX_RECORD_NUMBER, RecordError, load_record
from shoal.dht.records import NodeRecord as NodeRecordSchema
from shoal.dht.swarm import SwarmDHT
from shoal.logs import printable
from shoal.node import capacity
from shoal.node.engine import Progress
from shoal.node.machine import Machine
from shoal.p2p.links import LinkMonitor
from shoal.protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


def published_number(value: float | None, cap: float = MAX_RECORD_NUMBER) -> float | None:
    """A measurement as a record may carry it: None when unknown or not finite, capped at `cap`."""
    if value is None or not math.isfinite(value):
        return None
    return min(max(float(value), 0.0), cap)


def device_record(machine: Machine, run: RunConfig) -> dict:
    """Where this node computes, with its memory now (the accelerator's; the host's on the CPU) and
    its measured speed there."""
    info = describe(machine.device)
    return {
        "kind": info.kind,
        "name": printable(info.name, 80) or info.kind,
        "total_bytes": int(info.total_bytes),
        "free_bytes": int(min(info.free_bytes, info.total_bytes)),
        "planned_bytes": int(machine.memory_bytes),
        "tokens_per_s": float(published_number(capacity.tokens_per_s(run, machine.block_throughput)) or 0.0),
        "compute_dtype": "bfloat16" if machine.compute_dtype == torch.bfloat16 else "float32",
    }


@dataclass(frozen=True)
class Standing:
    """Where the node stands now, as the daemon keeps it (its engine reports the rest, `Progress`)."""

    role: str
    stage: int | None
    state: str  # joining, active or leaving
    max_inflight: int
    maddrs: list[str]
    reachable: bool | None  # the reachability self-check's verdict (None: not checked yet)
    relays: tuple[str, ...]  # the relays it is reached through (shoal/p2p/relay.py); (): dialed directly
    relay_service: bool  # it relays for nodes behind NAT
    placement_note: str | None  # why memory kept this node off the stage it would have taken


class NodeRecord:
    """Builds and publishes the record of one node of one run."""

    def __init__(
        self, dht: SwarmDHT, run: RunConfig, machine: Machine, links: LinkMonitor, started_at: float, ttl_s: float
    ) -> None:
        self.dht, self.run, self.machine, self.links = dht, run, machine, links
        self.started_at, self.ttl_s = started_at, ttl_s

    def build(self, standing: Standing, progress: Progress) -> dict:
        return {
            "kind": "node",
            "run_id": self.run.run_id,
            "peer_id": self.dht.peer_id,
            "maddrs": standing.maddrs,
            "role": standing.role,
            "stage": int(standing.stage or 0),
            "state": standing.state,
            "block_throughput": float(self.machine.block_throughput),
            "max_inflight": int(standing.max_inflight),
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
            "reachable": standing.reachable,
            "relays": list(standing.relays),
            "relay_service": standing.relay_service,
            "excluded": list(progress.excluded),  # [{peer_id, reason}], bounded by the engine
            "device": device_record(self.machine, self.run),
            "placement_note": standing.placement_note,
            "backup": dataclasses.asdict(progress.backup) if progress.backup is not None else None,
        }

    async def publish(self, standing: Standing, progress: Progress) -> bool:
        """Store the record now, and keep the run's own record alive: the run outlives its publisher."""
        record = self.build(standing, progress)
        try:
            load_record(NodeRecordSchema, record)
        except RecordError as e:
            logger.error("[%s] BUG: this node's own record fails its schema and is not published: %s",
                         self.dht.peer_id[-8:], e)  # fmt: skip
            raise
        stored = await self.dht.publish_node(record, self.ttl_s)
        if not stored:
            logger.warning("[%s] node record was not stored by any peer", self.dht.peer_id[-8:])
        await self.dht.republish_run(self.run.run_id, self.ttl_s)
        return stored
