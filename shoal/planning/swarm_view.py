"""SwarmView: an immutable snapshot of the live peers of one run, as plain data.

The daemon builds it from the DHT's node records (shoal.dht.view); every decision in planning/
takes one and returns a decision, so the simulator can drive the same code with made-up views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

PeerID = str  # base58 libp2p peer id
StageIndex = int

ROLE_DATA = "data"
ROLE_WORKER = "worker"
ROLE_ROLLOUT = "rollout"  # GRPO: holds a whole policy, no stage
STATE_JOINING = "joining"
STATE_ACTIVE = "active"
STATE_LEAVING = "leaving"


@dataclass(frozen=True)
class RepairNote:
    """A node rebuilt `stage` (no replica held it any more) by `rule` from the `sources` stages."""

    stage: StageIndex
    rule: str
    sources: tuple[StageIndex, ...]
    inner_step: int
    seconds: float
    at: float  # DHT time it went live
    note: str = ""


@dataclass(frozen=True)
class BackupNote:
    """A block-stage replica's latest backup snapshot, as its record announces it (train/backup_stream.py)."""

    version: int
    inner_step: int
    outer_epoch: int
    digest: str


@dataclass(frozen=True)
class DeviceNote:
    """Where a node computes, as its record says (dht/records.py DeviceRecord)."""

    kind: str  # torch's device type
    name: str
    total_bytes: int
    free_bytes: int
    planned_bytes: int  # the memory it planned its stage in (free at start, or its --memory-limit)
    tokens_per_s: float  # through one block, forward and backward
    compute_dtype: str  # "float32" or "bfloat16"


@dataclass(frozen=True)
class NodeInfo:
    peer_id: PeerID
    role: str  # ROLE_DATA (stage 0), ROLE_WORKER (a block stage) or ROLE_ROLLOUT (GRPO, stage 0)
    stage: StageIndex
    state: str
    block_throughput: float  # microbatches x blocks per second of forward+backward
    max_inflight: int  # microbatches it can keep activations for
    maddrs: tuple[str, ...] = ()
    inner_step: int = 0
    outer_epoch: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    grad_norm_clipped: float | None = None
    protocol_version: int = 1
    started_at: float = 0.0
    updated_at: float = 0.0
    expires_at: float = 0.0
    waiting_for: tuple[StageIndex, ...] = ()  # a data node's block stages with no live replica, while it waits
    links: tuple[tuple[PeerID, float, float], ...] = ()  # (peer, one-way latency s, bandwidth B/s) it measured
    replica_distance: float | None = None  # NoLoCo: ‖θ − θ_partner‖ before its last pair update
    averager_maddrs: tuple[str, ...] = ()  # DiLoCo: its averaging DHT's addresses
    repair: RepairNote | None = None  # CheckFree: how this node rebuilt its stage, if it did
    model_id: str | None = None  # GRPO: the policy a rollout worker samples with (PolicySpec.model_id)
    reachable: bool | None = None  # whether the peers it asked could open a connection to it (None: unknown)
    relays: tuple[str, ...] = ()  # the relays it is reached through (peer ids); (): dialed directly
    relay_service: bool = False  # it relays for nodes nobody can dial
    # peers it stopped trusting, with the reason: excluded from a data node's routes by its audits, or
    # refused as averaging partners by a worker's robust outer step
    excluded: tuple[tuple[PeerID, str], ...] = ()
    device: DeviceNote | None = None
    placement_note: str | None = None  # why memory kept it off the stage it would have taken
    backup: BackupNote | None = None  # a block-stage replica's latest snapshot for its keepers

    @property
    def live(self) -> bool:
        return self.state != STATE_LEAVING


def stage_misfit(node: NodeInfo, stages: int) -> str | None:
    """Why `node` cannot stand in a view of a run of `stages` stages, if it cannot: a data node and a
    rollout worker hold stage 0, a worker one block stage, 1..stages-1. A view that listed it would
    index the run's stages past their end (planning/from_view.py), or route through a data node."""
    if node.role == ROLE_WORKER:
        return None if 1 <= node.stage < stages else f"a worker of stage {node.stage}, outside 1..{stages - 1}"
    return None if node.stage == 0 else f"a {node.role} node of stage {node.stage}, not of stage 0"


@dataclass(frozen=True)
class SwarmView:
    run_id: str
    stages: int
    blocks_per_stage: tuple[int, ...]  # index s: number of blocks of stage s (0 for stage 0)
    nodes: tuple[NodeInfo, ...] = field(default_factory=tuple)
    taken_at: float = 0.0

    def live_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.live)

    def rollout_peers(self, exclude: PeerID | None = None) -> tuple[NodeInfo, ...]:
        """The active GRPO rollout workers, in peer-id order (so a seeded choice among them is stable)."""
        peers = (n for n in self.nodes if n.role == ROLE_ROLLOUT and n.state == STATE_ACTIVE and n.peer_id != exclude)
        return tuple(sorted(peers, key=lambda n: n.peer_id))

    def replicas(self, stage: StageIndex, exclude: PeerID | None = None) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.live_nodes() if n.stage == stage and n.peer_id != exclude)

    def stages_without_replica(self) -> list[StageIndex]:
        """The block stages no live node holds: until each has one, no microbatch can be routed."""
        return [s for s in range(1, self.stages) if not self.replicas(s)]

    def stage_throughput(self, stage: StageIndex, exclude: PeerID | None = None) -> float:
        """Microbatches per second the live replicas of a block stage can process together."""
        blocks = max(1, self.blocks_per_stage[stage])
        return sum(n.block_throughput for n in self.replicas(stage, exclude)) / blocks

    def measured_links(self) -> dict[tuple[PeerID, PeerID], tuple[float, float]]:
        """(from, to) -> (one-way latency s, bandwidth B/s) as the live nodes advertise them; a
        bandwidth of 0 means not measured yet (no large send on that link)."""
        return {
            (n.peer_id, peer): (latency, bandwidth) for n in self.live_nodes() for peer, latency, bandwidth in n.links
        }

    def with_throughput(self, throughput: Mapping[PeerID, float]) -> SwarmView:
        """The same view with these peers' `block_throughput` replaced (routing's observed figures)."""
        nodes = tuple(
            replace(n, block_throughput=throughput[n.peer_id]) if n.peer_id in throughput else n for n in self.nodes
        )
        return SwarmView(self.run_id, self.stages, self.blocks_per_stage, nodes, self.taken_at)

    def without(self, peer_ids: Iterable[PeerID]) -> SwarmView:
        gone = set(peer_ids)
        return SwarmView(
            self.run_id,
            self.stages,
            self.blocks_per_stage,
            tuple(n for n in self.nodes if n.peer_id not in gone),
            self.taken_at,
        )
