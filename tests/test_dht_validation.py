"""DHT validators between real peers: forged, foreign, spoofed and malformed records are refused."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from shoal.dht.identity import load_identity, peer_id_of
from shoal.dht.keys import DEFAULT_RUN_KEY, key_id, nodes_key, run_key
from shoal.dht.runs import run_record
from shoal.dht.swarm import SwarmDHT
from shoal.dht.validator import check_run_record
from shoal.errors import UsageError
from shoal.planning.swarm_view import BackupNote
from shoal.run_files import load_run_config

pytestmark = pytest.mark.timeout(120)

RUN = load_run_config("tiny")


REPAIR = {"stage": 2, "rule": "checkfree", "sources": [1, 3], "inner_step": 40, "seconds": 0.5, "at": 1.0, "note": ""}
BACKUP = {"version": 3, "inner_step": 30, "outer_epoch": 3, "digest": "ab" * 32}


def _node_record(peer_id: str, **changes) -> dict:
    record = {
        "kind": "node",
        "run_id": RUN.run_id,
        "peer_id": peer_id,
        "maddrs": [],
        "role": "worker",
        "stage": 1,
        "state": "active",
        "block_throughput": 3.0,
        "max_inflight": 8,
        "inner_step": 0,
        "outer_epoch": 0,
        "loss": None,
        "grad_norm": None,
        "grad_norm_clipped": None,
        "repair": None,
        "waiting_for": [],
        "links": [],
        "replica_distance": None,
        "averager_maddrs": [],
        "model_id": None,
        "reachable": None,
        "relays": [],
        "relay_service": False,
        "excluded": [],
        "device": {
            "kind": "cpu",
            "name": "test cpu",
            "total_bytes": 2**34,
            "free_bytes": 2**33,
            "planned_bytes": 2**33,
            "tokens_per_s": 1e5,
            "compute_dtype": "float32",
        },
        "placement_note": None,
        "backup": None,
        "protocol_version": 1,
        "started_at": time.time(),
        "updated_at": time.time(),
    }
    record.update(changes)
    return record


async def _two_peers() -> tuple[SwarmDHT, SwarmDHT]:
    first = await SwarmDHT.create(load_identity(None))
    second = await SwarmDHT.create(load_identity(None), initial_peers=await first.visible_maddrs())
    return first, second


def test_forged_foreign_and_malformed_records_are_refused():
    async def scenario():
        honest, attacker = await _two_peers()
        try:
            expires = get_dht_time() + 30
            assert await honest.publish_node(_node_record(honest.peer_id, repair=REPAIR, backup=BACKUP), ttl_s=30)
            key = nodes_key(RUN.run_id)

            # A record under the honest peer's subkey, signed by the attacker: refused.
            forged = _node_record(honest.peer_id, stage=2)
            assert not await attacker.node.store(key, forged, expires + 5, subkey=honest.owner_subkey)
            # A record that breaks the schema, under the attacker's own subkey: refused.
            for broken in (
                _node_record(attacker.peer_id, stage="two"),
                _node_record(attacker.peer_id, loss=-1.0),
                _node_record(attacker.peer_id, role="king"),
                _node_record(attacker.peer_id, role="rollout", model_id="m" * 97),  # over the bound
                _node_record(attacker.peer_id, role="rollout", model_id="a model"),  # not an id
                _node_record(attacker.peer_id, repair=dict(REPAIR, rule="magic")),
                _node_record(attacker.peer_id, repair=dict(REPAIR, sources=[1, 2, 3])),
                _node_record(attacker.peer_id, backup=dict(BACKUP, digest="not hex")),
                _node_record(attacker.peer_id, backup=dict(BACKUP, version=0)),
                _node_record(attacker.peer_id, backup=dict(BACKUP, digest=BACKUP["digest"][:63])),
                {"kind": "node"},
                [1, 2, 3],
                dict(_node_record(attacker.peer_id), extra=1),
            ):
                assert not await attacker.node.store(key, broken, expires, subkey=attacker.owner_subkey)
            # A valid record of this run stored under another run's key: refused.
            assert not await attacker.node.store(
                nodes_key("0" * 16), _node_record(attacker.peer_id), expires, subkey=attacker.owner_subkey
            )
            # Unsigned (no owner subkey): refused.
            assert not await attacker.node.store(key, _node_record(attacker.peer_id), expires, subkey=b"anyone")

            # A forged run config, with a valid claim: its run id does not hash from its content.
            claimed = run_record(RUN, attacker.identity.signing_key, get_dht_time())
            forged_run = dict(claimed, toml=RUN.replace({"optim.lr": 1.0}).to_toml())
            assert not await attacker.node.store(run_key("tiny"), forged_run, expires, subkey=attacker.owner_subkey)
            assert not await attacker.node.store(DEFAULT_RUN_KEY, forged_run, expires, subkey=attacker.owner_subkey)
            # An invalid run config inside a consistent-looking record: refused.
            bad = RUN.to_toml().replace("stages = 3", "stages = 40")
            assert not await attacker.node.store(
                run_key("tiny"), dict(forged_run, toml=bad), expires, subkey=attacker.owner_subkey
            )

            # What the honest peer sees: only its own, unchanged record; and no run config.
            view = await honest.read_view(RUN)
            assert [(n.peer_id, n.stage) for n in view.nodes] == [(honest.peer_id, 1)]
            assert (view.nodes[0].repair.rule, view.nodes[0].repair.sources) == ("checkfree", (1, 3))
            assert view.nodes[0].backup == BackupNote(**BACKUP)  # what a restore holds a kept snapshot to
            assert await attacker.read_runs("tiny") == []
            # The real config, published by its host, is accepted and verifiable.
            assert await honest.publish_run(RUN, ttl_s=30, as_default=True)
            assert [p.config.run_id for p in await attacker.read_runs(None)] == [RUN.run_id]
        finally:
            await attacker.shutdown()
            await honest.shutdown()

    asyncio.run(scenario())


def test_a_record_naming_another_peer_is_refused():
    """The peer id in a node record must be the libp2p identity of the key that signed it."""

    async def scenario():
        honest, attacker = await _two_peers()
        try:
            key, expires = nodes_key(RUN.run_id), get_dht_time() + 30
            assert (
                attacker.peer_id
                == attacker.identity.peer_id
                == peer_id_of(attacker.identity.signing_key.get_public_key().to_bytes())
            )
            # Signed by the attacker, under its own subkey, naming the honest peer: refused.
            assert not await attacker.node.store(
                key, _node_record(honest.peer_id), expires, subkey=attacker.owner_subkey
            )
            # ...or naming a peer id of a key nobody runs: refused as well.
            stranger = peer_id_of(RSAPrivateKey().get_public_key().to_bytes())
            assert not await attacker.node.store(key, _node_record(stranger), expires, subkey=attacker.owner_subkey)
            # The publishing path refuses it too: every peer drops it, nothing is stored.
            assert not await attacker.publish_node(_node_record(honest.peer_id), ttl_s=30)
            # Its own record, signed by its own key: accepted, and the only one the honest peer sees.
            assert await attacker.publish_node(_node_record(attacker.peer_id), ttl_s=30)
            view = await honest.read_view(RUN)
            assert [n.peer_id for n in view.nodes] == [attacker.peer_id]
        finally:
            await attacker.shutdown()
            await honest.shutdown()

    asyncio.run(scenario())


def test_a_forged_claim_on_a_run_is_refused():
    """Anyone may republish a run record as it is; nobody may change the claim inside it."""

    async def scenario():
        honest, attacker = await _two_peers()
        try:
            expires = get_dht_time() + 30
            record = run_record(RUN, honest.identity.signing_key, claimed_at=get_dht_time())
            # The claim backdated, or its signature replaced by the attacker's: refused.
            backdated = dict(record, published_at=1.0)
            resigned = dict(
                record, claim_signature=run_record(RUN, attacker.identity.signing_key, 1.0)["claim_signature"]
            )
            for forged in (backdated, resigned, dict(record, publisher_key="ssh-rsa AAAA")):
                assert not await attacker.node.store(run_key(RUN.name), forged, expires, subkey=attacker.owner_subkey)
            # The honest claim republished by the attacker, unchanged: accepted, and still the honest peer's.
            assert await attacker.node.store(run_key(RUN.name), record, expires, subkey=attacker.owner_subkey)
            [published] = await honest.read_runs(RUN.name)
            assert (published.config.run_id, published.publisher) == (RUN.run_id, honest.peer_id)
            assert published.holders == (attacker.peer_id,)
        finally:
            await attacker.shutdown()
            await honest.shutdown()

    asyncio.run(scenario())


def test_identity_file_keeps_peer_id_and_signing_key(tmp_path):
    path = str(tmp_path / "node.id")
    first = load_identity(path)

    async def peer_id() -> str:
        dht = await SwarmDHT.create(load_identity(path))
        try:
            return dht.peer_id
        finally:
            await dht.shutdown()

    # One key: the libp2p daemon runs as the identity's peer id, across restarts.
    assert asyncio.run(peer_id()) == asyncio.run(peer_id()) == first.peer_id
    again = load_identity(path)
    assert first.signing_key.get_public_key().to_bytes() == again.signing_key.get_public_key().to_bytes()
    (tmp_path / "junk.id").write_bytes(b"not a key")
    with pytest.raises(UsageError, match="not a libp2p RSA identity"):
        load_identity(str(tmp_path / "junk.id"))


def test_a_run_record_is_checked_once_per_content_and_a_refusal_is_never_kept():
    """Every view refresh reads the run record again: its config parse and signature check are done
    once for the same bytes under the same key, while a forged variant is refused every time."""
    key = RSAPrivateKey()
    record = run_record(RUN, key, claimed_at=1000.0)
    record_key = key_id(run_key(RUN.name))
    value = MSGPackSerializer.dumps(record)
    forged = MSGPackSerializer.dumps(dict(record, published_at=1.0))
    check_run_record.cache_clear()
    for _ in range(3):
        check_run_record(record_key, value)
        with pytest.raises(ValueError, match="not signed by its publisher"):
            check_run_record(record_key, forged)
    with pytest.raises(ValueError, match="under a foreign key"):
        check_run_record(key_id(run_key("another-run")), value)
    info = check_run_record.cache_info()
    assert (info.hits, info.currsize) == (2, 1)


def test_a_record_whose_stage_does_not_fit_its_role_or_the_run_is_left_out_of_views(caplog):
    """A peer's own signed record, valid by the schema, of a worker at the run's stage count (3), of a
    data node at block stage 2, of a rollout worker at stage 1: each is left out of the view, which a
    planner then takes (one at or past the stage count made `swarm_from_view` raise IndexError on every
    view of the run), and said once however many views are read. Its record at a stage that fits is
    listed."""
    from shoal.planning.costs import CostModel
    from shoal.planning.from_view import swarm_from_view

    cost = CostModel(activation_bytes=1024)

    async def scenario() -> tuple[str, str, list[list[str]]]:
        honest, attacker = await _two_peers()
        try:
            assert await honest.publish_node(_node_record(honest.peer_id), ttl_s=30)
            seen = []
            for role, stage in (("worker", 3), ("data", 2), ("rollout", 1), ("worker", 2)):
                assert await attacker.publish_node(_node_record(attacker.peer_id, role=role, stage=stage), ttl_s=30)
                for _ in range(2):
                    view = await honest.read_view(RUN)
                    swarm, _ = swarm_from_view(view, cost)
                    assert len(swarm.nodes) == len(view.nodes)
                seen.append(sorted(n.peer_id for n in view.nodes))
            return honest.peer_id, attacker.peer_id, seen
        finally:
            await attacker.shutdown()
            await honest.shutdown()

    with caplog.at_level("WARNING", logger="shoal.dht.swarm"):
        honest, attacker, seen = asyncio.run(scenario())
    assert RUN.pipeline.stages == 3
    assert seen == [[honest]] * 3 + [sorted([honest, attacker])]
    left_out = [r.getMessage() for r in caplog.records if "out of the view" in r.getMessage()]
    assert [m.split(": ", 1)[1] for m in left_out] == [
        "a worker of stage 3, outside 1..2",
        "a data node of stage 2, not of stage 0",
        "a rollout node of stage 1, not of stage 0",
    ]
