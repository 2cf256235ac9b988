"""Run records between real peers: a run outlives its publisher, and runs sharing a name resolve the same way
everywhere, with a report, never a dead end."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from shoal.bootstrap.peer import BootstrapPeer
from shoal.dht.identity import load_identity
from shoal.dht.runs import rank_runs
from shoal.dht.swarm import LOOPBACK_MADDRS, SwarmDHT
from shoal.node.config import NodeConfig, RunChoice
from shoal.node.run_source import resolve_run
from shoal.run_files import load_run_config
from tests.helpers.tiny import tiny_run, write_tiny_run

pytestmark = pytest.mark.timeout(300)

RUN_TTL_S = 3.0  # the bootstrap peer's run record: the shortest TTL it accepts


def test_two_runs_under_one_name_resolve_to_the_first_claim_with_a_report(caplog):
    first_run, second_run = tiny_run(), tiny_run(**{"optim.lr": 5e-3})
    assert first_run.name == second_run.name and first_run.run_id != second_run.run_id

    async def scenario():
        first = await BootstrapPeer.create(None, LOOPBACK_MADDRS, (), run=first_run, record_ttl_s=30)
        entry = await first.maddrs()
        with caplog.at_level(logging.WARNING, logger="shoal.bootstrap.peer"):
            # A second bootstrap peer publishes another run under the same name, later, as the default too.
            second = await BootstrapPeer.create(None, LOOPBACK_MADDRS, (), entry, run=second_run, record_ttl_s=30)
        told = [r.getMessage() for r in caplog.records]
        assert len(told) == 2 and all(
            f"joining the first claimed, {first_run.name}@{first_run.run_id}" in m for m in told
        )
        readers = [await SwarmDHT.create(load_identity(None), initial_peers=entry, client_mode=True) for _ in range(2)]
        try:
            for key in (first_run.name, None):  # under its name, and as the swarm's default
                published = await readers[0].read_runs(key)
                assert [p.config.run_id for p in published] == [first_run.run_id, second_run.run_id]
                assert [p.publisher for p in published] == [first.dht.peer_id, second.dht.peer_id]
                assert rank_runs(reversed(published)) == published  # the order of arrival does not matter

            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="shoal.node.run_source"):
                chosen = [
                    await resolve_run(reader, NodeConfig(run=RunChoice(run_name=first_run.name))) for reader in readers
                ]
                by_default = await resolve_run(readers[0], NodeConfig())
            assert [c.run_id for c in chosen] == [first_run.run_id] * 2
            assert by_default.run_id == first_run.run_id
            reports = [r.getMessage() for r in caplog.records]
            assert len(reports) == 3, reports
            for report, under, hint in zip(
                reports,
                [f"under the name {first_run.name!r}"] * 2 + ["as the swarm's default"],
                [f"--run {first_run.name}@RUN_ID"] * 2 + ["--run NAME@RUN_ID"],
                strict=True,
            ):
                assert (
                    f"2 runs are published {under}; joining the first claimed, {first_run.name}@{first_run.run_id}"
                    in report
                )
                assert f"also published: {second_run.name}@{second_run.run_id} (claimed at 20" in report
                assert hint in report

            # The other run stays reachable by its id, without a warning.
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="shoal.node.run_source"):
                pinned = await resolve_run(
                    readers[1], NodeConfig(run=RunChoice(run_name=f"{second_run.name}@{second_run.run_id[:8]}"))
                )
            assert pinned.run_id == second_run.run_id and not caplog.records
        finally:
            for peer in (*readers, second, first):
                await peer.shutdown()

    asyncio.run(scenario())


async def _run_held_only_by_others(entry: str, dead: str, name: str, timeout_s: float = 30.0):
    """Read the run `name` through `entry` until `dead` no longer holds it (its copy expired)."""
    client = await SwarmDHT.create(load_identity(None), initial_peers=[entry], client_mode=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            published = await client.read_runs(name)
            if published and dead not in published[0].holders:
                return published
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the run record of the dead peer {dead} did not expire within {timeout_s:.0f} s")
    finally:
        await client.shutdown()


@pytest.mark.multiprocess
def test_a_run_outlives_its_bootstrap_peer_for_newcomers(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path)
    run = load_run_config(str(run_file))
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file), "--record-ttl", str(RUN_TTL_S))
    bootstrap_id = bootstrap.maddrs[0].rsplit("/p2p/", 1)[1]
    holder = swarm.start_node([bootstrap.maddrs[0]], "--record-ttl", "6")  # joins the default run
    swarm.kill(bootstrap)

    # The bootstrap peer's own copy expires (its TTL passes); the node that joined keeps the run alive,
    # the claim unchanged.
    [published] = asyncio.run(_run_held_only_by_others(holder.maddrs[0], bootstrap_id, run.name))
    assert published.config.run_id == run.run_id
    assert (published.publisher, published.holders) == (bootstrap_id, (holder.peer_id,))

    # A newcomer that never saw the bootstrap peer resolves the run by name through the holder.
    newcomer = swarm.start_node([holder.maddrs[0]], "--record-ttl", "6", "--run", run.name)
    assert json.loads(newcomer.ready_file.read_text())["run_id"] == run.run_id
    doc = swarm.status(newcomer.maddrs[0], "--run", run.name)
    assert doc["run"]["name"] == run.name
    assert {n["peer_id"] for n in doc["nodes"]} == {holder.peer_id, newcomer.peer_id}
