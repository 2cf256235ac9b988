"""DHT validators between real peers: forged, foreign and malformed records are refused."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils import get_dht_time

from shoal.config import load_run_config
from shoal.dht.identity import load_identity
from shoal.dht.keys import DEFAULT_RUN_KEY, nodes_key, run_key
from shoal.dht.swarm import SwarmDHT

pytestmark = pytest.mark.timeout(120)

RUN = load_run_config("tiny")


REPAIR = {"stage": 2, "rule": "checkfree", "sources": [1, 3], "inner_step": 40, "seconds": 0.5, "at": 1.0, "note": ""}


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
            assert await honest.publish_node(_node_record(honest.peer_id, repair=REPAIR), ttl_s=30)
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

            # A forged run config: its run id does not hash from its content.
            forged_run = {
                "kind": "run",
                "name": "tiny",
                "run_id": RUN.run_id,
                "published_at": 1.0,
                "toml": RUN.replace({"optim.lr": 1.0}).to_toml(),
            }
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
            assert await attacker.read_runs("tiny") == []
            # The real config, published by its host, is accepted and verifiable.
            assert await honest.publish_run(RUN, ttl_s=30, as_default=True)
            assert [c.run_id for c in await attacker.read_runs(None)] == [RUN.run_id]
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

    assert asyncio.run(peer_id()) == asyncio.run(peer_id())
    again = load_identity(path)
    assert first.signing_key.get_public_key().to_bytes() == again.signing_key.get_public_key().to_bytes()
