"""Schemas of the values shoal stores in the DHT: frozen dataclasses read by `protocol/schema.py`.

Every peer checks every value it is asked to store or receives against these (see validator.py),
so a malformed record never enters anyone's view. The records are exact: an int where a float is
declared, a list where a map is, or a field too many is refused (nothing is coerced).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.planning.swarm_view import (
    ROLE_DATA,
    ROLE_ROLLOUT,
    ROLE_WORKER,
    STATE_ACTIVE,
    STATE_JOINING,
    STATE_LEAVING,
    BackupNote,
    DeviceNote,
    NodeInfo,
    RepairNote,
)
from shoal.protocol.errors import MalformedMessage
from shoal.protocol.schema import FieldOptions, load_document, wire_field

MAX_MADDRS = 16
MAX_LINKS = 32
MAX_RELAYS_LISTED = 8
MAX_EXCLUDED = 16  # peers a node lists as excluded (see ExclusionRecord)
MAX_RUN_TOML_BYTES = 16 * 1024
MAX_KEY_CHARS = 1024  # an OpenSSH RSA key or a base64 signature of up to ~6000 bits
MAX_RECORD_NUMBER = 1e12  # measurements in a record (throughput, loss, norms) stay within this
MAX_STAGE = 4096

_PEER_ID = r"[A-Za-z0-9._@:-]+"


def _id() -> Any:
    return wire_field(min_len=1, max_len=128, pattern=_PEER_ID)


def _measure() -> Any:
    return wire_field(ge=0.0, le=MAX_RECORD_NUMBER)


def _maddrs() -> Any:
    return wire_field(max_len=MAX_MADDRS, item=FieldOptions(max_len=512))


R = TypeVar("R")


class RecordError(ValueError):
    """A DHT value that is not a valid shoal record; `str()` names the field."""


@dataclass(frozen=True, kw_only=True)
class LinkRecord:
    """One link a node measured: half its ping round trip, and the bandwidth of its tensor sends."""

    peer_id: str = _id()
    latency_s: float = wire_field(ge=0.0, le=60.0)
    bandwidth_Bps: float = _measure()


@dataclass(frozen=True, kw_only=True)
class RepairRecord:
    """How this node rebuilt a stage nobody held any more (CheckFree): the rule, from which stages."""

    stage: int = wire_field(ge=1, le=MAX_STAGE)
    rule: str = wire_field(choices=("checkfree", "copy_partner", "copy", "uniform", "random", "backup", "checkpoint"))
    sources: tuple[int, ...] = wire_field(max_len=2, item=FieldOptions(ge=1, le=MAX_STAGE))
    inner_step: int = wire_field(ge=0)
    seconds: float = _measure()
    at: float = _measure()
    note: str = wire_field(max_len=200)


@dataclass(frozen=True, kw_only=True)
class BackupRecord:
    """A block-stage replica's latest backup snapshot (shoal/train/backup_stream.py): its keepers and a
    node restoring the stage check the snapshot they hold against this digest."""

    version: int = wire_field(ge=1)
    inner_step: int = wire_field(ge=0)
    outer_epoch: int = wire_field(ge=0)
    digest: str = wire_field(max_len=64, pattern=r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class ExclusionRecord:
    """A peer this node stopped trusting, and why: a data node's audits excluded it from its routes, or
    a worker's robust outer step refused it as an averaging partner (docs/security.md)."""

    peer_id: str = _id()
    reason: str = wire_field(max_len=200)


@dataclass(frozen=True, kw_only=True)
class DeviceRecord:
    """Where a node computes (shoal/device.py): the device's kind and name, its memory (an
    accelerator's; the host's for the CPU) total and free now, what the node planned its stage in, its
    measured tokens/s through one block there, and the precision its matrix products run in."""

    kind: str = wire_field(min_len=1, max_len=16, pattern=r"[a-z]+")  # torch's device type
    name: str = wire_field(min_len=1, max_len=80)
    total_bytes: int = wire_field(ge=0, le=2**60)
    free_bytes: int = wire_field(ge=0, le=2**60)
    planned_bytes: int = wire_field(ge=0, le=2**60)
    tokens_per_s: float = _measure()
    compute_dtype: str = wire_field(choices=("float32", "bfloat16"))


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    kind: str = wire_field(choices=("node",))
    run_id: str = _id()
    peer_id: str = _id()
    maddrs: tuple[str, ...] = _maddrs()
    role: str = wire_field(choices=(ROLE_DATA, ROLE_WORKER, ROLE_ROLLOUT))
    stage: int = wire_field(ge=0, le=MAX_STAGE)
    state: str = wire_field(choices=(STATE_JOINING, STATE_ACTIVE, STATE_LEAVING))
    block_throughput: float = _measure()
    max_inflight: int = wire_field(ge=0, le=1_000_000)
    inner_step: int = wire_field(ge=0)
    outer_epoch: int = wire_field(ge=0)
    loss: float | None = _measure()
    grad_norm: float | None = _measure()
    grad_norm_clipped: float | None = _measure()
    protocol_version: int = wire_field(ge=0, le=1_000_000)
    started_at: float = _measure()
    updated_at: float = _measure()
    # a data node's block stages that have no live replica while it waits for one
    waiting_for: tuple[int, ...] = wire_field(max_len=64, item=FieldOptions(ge=0, le=MAX_STAGE))
    links: tuple[LinkRecord, ...] = wire_field(max_len=MAX_LINKS)
    replica_distance: float | None = _measure()
    # DiLoCo: where this replica's averaging DHT listens (hivemind's averager needs a DHT of its own)
    averager_maddrs: tuple[str, ...] = _maddrs()
    repair: RepairRecord | None
    # whether the peers it asked could open a connection to it (node/reachability.py); None: not checked
    reachable: bool | None
    # the relays it is reached through (peer ids; p2p/relay.py), and whether it relays for others
    relays: tuple[str, ...] = wire_field(max_len=MAX_RELAYS_LISTED, item=FieldOptions(max_len=128, pattern=_PEER_ID))
    relay_service: bool
    excluded: tuple[ExclusionRecord, ...] = wire_field(max_len=MAX_EXCLUDED)
    # GRPO: the policy a rollout worker samples with (PolicySpec.model_id); None for pipeline nodes
    model_id: str | None = wire_field(min_len=1, max_len=96, pattern=r"[A-Za-z0-9._-]+")
    device: DeviceRecord
    # why memory kept this node off the stage it would have taken ("stage 2 needs ~9.1 GiB, ...")
    placement_note: str | None = wire_field(max_len=200)
    backup: BackupRecord | None


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    kind: str = wire_field(choices=("run",))
    name: str = _id()
    run_id: str = _id()
    toml: str = wire_field(max_len=MAX_RUN_TOML_BYTES)
    # the claim (runs.py): when and by which key the run was published, signed by that key; any
    # holder of the run republishes the record unchanged under its own subkey
    published_at: float = _measure()
    publisher_key: str = wire_field(max_len=MAX_KEY_CHARS, pattern=r"ssh-rsa [A-Za-z0-9+/]+=*")
    claim_signature: str = wire_field(max_len=MAX_KEY_CHARS, pattern=r"[A-Za-z0-9+/]+=*")


def load_record(cls: type[R], value: Any) -> R:
    """`value` (a decoded msgpack map) read as a `cls`, exactly; raises `RecordError` naming the field."""
    try:
        return load_document(cls, value, exact=True)
    except MalformedMessage as e:
        raise RecordError(f"{cls.__name__}: {e.message}") from None


def node_info(record: NodeRecord, expires_at: float) -> NodeInfo:
    repair = record.repair
    return NodeInfo(
        peer_id=record.peer_id,
        role=record.role,
        stage=record.stage,
        state=record.state,
        block_throughput=record.block_throughput,
        max_inflight=record.max_inflight,
        maddrs=record.maddrs,
        inner_step=record.inner_step,
        outer_epoch=record.outer_epoch,
        waiting_for=record.waiting_for,
        replica_distance=record.replica_distance,
        averager_maddrs=record.averager_maddrs,
        links=tuple((link.peer_id, link.latency_s, link.bandwidth_Bps) for link in record.links),
        loss=record.loss,
        grad_norm=record.grad_norm,
        grad_norm_clipped=record.grad_norm_clipped,
        repair=None if repair is None else RepairNote(**dataclasses.asdict(repair)),
        model_id=record.model_id,
        reachable=record.reachable,
        relays=record.relays,
        relay_service=record.relay_service,
        excluded=tuple((e.peer_id, e.reason) for e in record.excluded),
        device=DeviceNote(**dataclasses.asdict(record.device)),
        placement_note=record.placement_note,
        backup=None if record.backup is None else BackupNote(**dataclasses.asdict(record.backup)),
        protocol_version=record.protocol_version,
        started_at=record.started_at,
        updated_at=record.updated_at,
        expires_at=expires_at,
    )
