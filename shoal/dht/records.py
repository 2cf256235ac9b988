"""Schemas of the values shoal stores in the DHT, as strict pydantic.v1 models.

Every peer checks every value it is asked to store or receives against these (see validator.py),
so a malformed record never enters anyone's view. hivemind's schema machinery is pydantic.v1.
"""

from __future__ import annotations

from typing import Any

from pydantic import v1 as pydantic

from shoal.planning.swarm_view import (
    ROLE_DATA,
    ROLE_ROLLOUT,
    ROLE_WORKER,
    STATE_ACTIVE,
    STATE_JOINING,
    STATE_LEAVING,
    NodeInfo,
    RepairNote,
)

MAX_MADDRS = 16
MAX_LINKS = 32
MAX_EXCLUDED = 16  # peers a node lists as excluded (see ExclusionRecord)
MAX_RUN_TOML_BYTES = 16 * 1024
MAX_KEY_CHARS = 1024  # an OpenSSH RSA key or a base64 signature of up to ~6000 bits


class _Strict(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False


MAX_RECORD_NUMBER = 1e12  # measurements in a record (throughput, loss, norms) stay within this
_finite = pydantic.confloat(strict=True, ge=0.0, le=MAX_RECORD_NUMBER)
_id = pydantic.constr(strict=True, min_length=1, max_length=128, regex=r"^[A-Za-z0-9._@:-]+$")


class LinkRecord(_Strict):
    """One link a node measured: half its ping round trip, and the bandwidth of its tensor sends."""

    peer_id: _id  # type: ignore[valid-type]
    latency_s: pydantic.confloat(strict=True, ge=0.0, le=60.0)  # type: ignore[valid-type]
    bandwidth_Bps: _finite  # type: ignore[valid-type]


class RepairRecord(_Strict):
    """How this node rebuilt a stage nobody held any more (CheckFree): the rule, from which stages."""

    stage: pydantic.conint(strict=True, ge=1, le=4096)  # type: ignore[valid-type]
    rule: pydantic.constr(strict=True, regex="^(checkfree|copy_partner|copy|uniform|random)$")  # type: ignore[valid-type]
    sources: pydantic.conlist(pydantic.conint(strict=True, ge=1, le=4096), max_items=2)  # type: ignore[valid-type]
    inner_step: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    seconds: _finite  # type: ignore[valid-type]
    at: _finite  # type: ignore[valid-type]
    note: pydantic.constr(strict=True, max_length=200)  # type: ignore[valid-type]


class ExclusionRecord(_Strict):
    """A peer this node stopped trusting, and why: a data node's audits excluded it from its routes, or
    a worker's robust outer step refused it as an averaging partner (docs/security.md)."""

    peer_id: _id  # type: ignore[valid-type]
    reason: pydantic.constr(strict=True, max_length=200)  # type: ignore[valid-type]


class NodeRecord(_Strict):
    kind: pydantic.constr(strict=True, regex="^node$")  # type: ignore[valid-type]
    run_id: _id  # type: ignore[valid-type]
    peer_id: _id  # type: ignore[valid-type]
    maddrs: pydantic.conlist(pydantic.constr(strict=True, max_length=512), max_items=MAX_MADDRS)  # type: ignore[valid-type]
    role: pydantic.constr(strict=True, regex=f"^({ROLE_DATA}|{ROLE_WORKER}|{ROLE_ROLLOUT})$")  # type: ignore[valid-type]
    stage: pydantic.conint(strict=True, ge=0, le=4096)  # type: ignore[valid-type]
    state: pydantic.constr(strict=True, regex=f"^({STATE_JOINING}|{STATE_ACTIVE}|{STATE_LEAVING})$")  # type: ignore[valid-type]
    block_throughput: _finite  # type: ignore[valid-type]
    max_inflight: pydantic.conint(strict=True, ge=0, le=1_000_000)  # type: ignore[valid-type]
    inner_step: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    outer_epoch: pydantic.conint(strict=True, ge=0)  # type: ignore[valid-type]
    loss: _finite | None  # type: ignore[valid-type]
    grad_norm: _finite | None  # type: ignore[valid-type]
    grad_norm_clipped: _finite | None  # type: ignore[valid-type]
    protocol_version: pydantic.conint(strict=True, ge=0, le=1_000_000)  # type: ignore[valid-type]
    started_at: _finite  # type: ignore[valid-type]
    updated_at: _finite  # type: ignore[valid-type]
    # a data node's block stages that have no live replica while it waits for one
    waiting_for: pydantic.conlist(pydantic.conint(strict=True, ge=0, le=4096), max_items=64)  # type: ignore[valid-type]
    links: pydantic.conlist(LinkRecord, max_items=MAX_LINKS)  # type: ignore[valid-type]
    replica_distance: _finite | None  # type: ignore[valid-type]
    # DiLoCo: where this replica's averaging DHT listens (hivemind's averager needs a DHT of its own)
    averager_maddrs: pydantic.conlist(pydantic.constr(strict=True, max_length=512), max_items=MAX_MADDRS)  # type: ignore[valid-type]
    repair: RepairRecord | None
    # whether the peers it asked could open a connection to it (node/reachability.py); None: not checked
    reachable: pydantic.StrictBool | None
    excluded: pydantic.conlist(ExclusionRecord, max_items=MAX_EXCLUDED)  # type: ignore[valid-type]
    # GRPO: the policy a rollout worker samples with (PolicySpec.model_id); None for pipeline nodes
    model_id: pydantic.constr(strict=True, min_length=1, max_length=96, regex=r"^[A-Za-z0-9._-]+$") | None  # type: ignore[valid-type]


class RunRecord(_Strict):
    kind: pydantic.constr(strict=True, regex="^run$")  # type: ignore[valid-type]
    name: _id  # type: ignore[valid-type]
    run_id: _id  # type: ignore[valid-type]
    toml: pydantic.constr(strict=True, max_length=MAX_RUN_TOML_BYTES)  # type: ignore[valid-type]
    # the claim (runs.py): when and by which key the run was published, signed by that key; any
    # holder of the run republishes the record unchanged under its own subkey
    published_at: _finite  # type: ignore[valid-type]
    publisher_key: pydantic.constr(strict=True, max_length=MAX_KEY_CHARS, regex=r"^ssh-rsa [A-Za-z0-9+/]+=*$")  # type: ignore[valid-type]
    claim_signature: pydantic.constr(strict=True, max_length=MAX_KEY_CHARS, regex=r"^[A-Za-z0-9+/]+=*$")  # type: ignore[valid-type]


def check_exact(model: type[_Strict], value: Any) -> _Strict:
    """Parse and insist nothing was coerced (pydantic.v1 would turn 3.0 into 3 otherwise)."""
    if not isinstance(value, dict):
        raise ValueError("record is not a map")
    parsed = model.parse_obj(value)
    if parsed.dict() != value:
        raise ValueError("record fields changed type under validation")
    return parsed


def node_info(record: NodeRecord, expires_at: float) -> NodeInfo:
    return NodeInfo(
        peer_id=record.peer_id,
        role=record.role,
        stage=record.stage,
        state=record.state,
        block_throughput=record.block_throughput,
        max_inflight=record.max_inflight,
        maddrs=tuple(record.maddrs),
        inner_step=record.inner_step,
        outer_epoch=record.outer_epoch,
        waiting_for=tuple(record.waiting_for),
        replica_distance=record.replica_distance,
        averager_maddrs=tuple(record.averager_maddrs),
        links=tuple((link.peer_id, link.latency_s, link.bandwidth_Bps) for link in record.links),
        loss=record.loss,
        grad_norm=record.grad_norm,
        grad_norm_clipped=record.grad_norm_clipped,
        repair=None
        if record.repair is None
        else RepairNote(**{**record.repair.dict(), "sources": tuple(record.repair.sources)}),
        model_id=record.model_id,
        reachable=record.reachable,
        excluded=tuple((e.peer_id, e.reason) for e in record.excluded),
        protocol_version=record.protocol_version,
        started_at=record.started_at,
        updated_at=record.updated_at,
        expires_at=expires_at,
    )
