"""Run records: a publisher's signed claim on a run name, and the choice among runs under one name.

A run record carries the run's config and a *claim*: the publisher's public key and its signature
over (name, run id, claimed_at). The claim is what pins the run to its publisher, not the DHT
subkey the record sits under. That is what lets every node of the run republish the record under
its own subkey (its own signature, its own expiration, which nobody else can extend), so the run
stays resolvable as long as any of its nodes lives, not only while its publisher does.

Several runs may be published under one name. None is refused (a peer cannot know who was first
from what it stores), none blocks joiners: every reader ranks them the same way, the earliest
claim first (then the publisher's peer id, then the run id), joins the first and reports the rest
with how to pick one (`--run NAME@RUN_ID`). A claim's time is chosen by its claimant: a squatter can
backdate one, so a name is a convenience and `NAME@RUN_ID` (a content hash) is the real pin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from shoal.config import RunConfig
from shoal.dht.identity import peer_id_of

_CLAIM_DOMAIN = b"shoal run claim\x00"  # never a prefix of what hivemind signs (a msgpack array)


def _claim_payload(name: str, run_id: str, claimed_at: float) -> bytes:
    return _CLAIM_DOMAIN + MSGPackSerializer.dumps([name, run_id, float(claimed_at)])


def run_record(config: RunConfig, key: RSAPrivateKey, claimed_at: float) -> dict[str, Any]:
    """A run record claimed by `key` at `claimed_at` (the schema is RunRecord in records.py)."""
    return {
        "kind": "run",
        "name": config.name,
        "run_id": config.run_id,
        "toml": config.to_toml(),
        "published_at": float(claimed_at),
        "publisher_key": key.get_public_key().to_bytes().decode(),
        "claim_signature": key.sign(_claim_payload(config.name, config.run_id, claimed_at)).decode(),
    }


def verify_claim(record: dict[str, Any]) -> str:
    """Check a schema-valid run record's claim; return the publisher's peer id, or raise ValueError."""
    public_key = record["publisher_key"].encode()
    publisher = peer_id_of(public_key)  # raises ValueError on anything but an RSA key
    payload = _claim_payload(record["name"], record["run_id"], record["published_at"])
    if not RSAPublicKey.from_bytes(public_key).verify(payload, record["claim_signature"].encode()):
        raise ValueError(f"run {record['name']}@{record['run_id']}: the claim is not signed by its publisher")
    return publisher


@dataclass(frozen=True)
class PublishedRun:
    config: RunConfig
    publisher: str  # peer id of the key that claimed the name for this run
    claimed_at: float
    holders: tuple[str, ...]  # peer ids that keep the record alive now (publisher or republishers)
    record: dict[str, Any]  # the claimed record, as any holder republishes it

    @property
    def label(self) -> str:
        return f"{self.config.name}@{self.config.run_id}"

    def precedence(self) -> tuple[float, str, str]:
        return (self.claimed_at, self.publisher, self.config.run_id)


def rank_runs(found: Iterable[PublishedRun]) -> list[PublishedRun]:
    """One entry per run id (its earliest claim, holders merged), in the order every reader uses."""
    by_run: dict[str, PublishedRun] = {}
    for run in found:
        seen = by_run.get(run.config.run_id)
        if seen is None:
            by_run[run.config.run_id] = run
            continue
        first = min(seen, run, key=PublishedRun.precedence)
        holders = tuple(sorted(set(seen.holders) | set(run.holders)))
        by_run[run.config.run_id] = PublishedRun(first.config, first.publisher, first.claimed_at, holders, first.record)
    return sorted(by_run.values(), key=PublishedRun.precedence)


def collision_report(ranked: list[PublishedRun], name: str | None) -> str | None:
    """What a user should read when several runs share a name (None: the swarm's default): which one
    is joined, why, and the others."""
    if len(ranked) < 2:
        return None
    chosen, others = ranked[0], ranked[1:]

    def describe(run: PublishedRun) -> str:
        at = datetime.fromtimestamp(run.claimed_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{run.label} (claimed at {at} by …{run.publisher[-10:]}, {len(run.holders)} holder(s))"

    under = f"under the name {name!r}" if name else "as the swarm's default"
    return (
        f"{len(ranked)} runs are published {under}; joining the first claimed, {describe(chosen)}; "
        f"also published: {'; '.join(describe(r) for r in others)}. "
        f"Pass --run {name or 'NAME'}@RUN_ID to choose one."
    )
