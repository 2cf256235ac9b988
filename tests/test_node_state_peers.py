"""What a restart joins through beside its initial peers, and a libp2p daemon that starts slowly.

The peers a node saw live are kept in its --state-dir (shoal/node/state/peers.py): read back as a hint
only, each entry checked, a bad file set aside with one line. The libp2p daemon's start is tried
again, each try waiting longer, where it failed otherwise than by its initial peers
(shoal/dht/swarm.py); the multi-process restart test (tests/test_node_restart.py) shows a restarted
node whose only initial peer died joining through the peers it kept.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hivemind.p2p import P2P, P2PDaemonError

from shoal.dht import swarm as swarm_module
from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.node.state.peers import MAX_KNOWN_PEERS, PEERS_FILE, PeerMemory, known_peers
from shoal.planning.swarm_view import NodeInfo, SwarmView

ME = "QmSelf" + "1" * 40


def peer(i: int, state: str = "active") -> NodeInfo:
    peer_id = "QmPeer" + "abcdefghijkmnopqrstuvwxyz"[i] + "a" * 39  # base58: no 0, O, I or l
    return NodeInfo(peer_id, "worker", 1, state, 1.0, 1, maddrs=(f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{peer_id}",))


def view(*nodes: NodeInfo) -> SwarmView:
    return SwarmView("run", 2, (0, 1), nodes)


def test_the_live_peers_of_a_view_are_kept_bounded_and_without_the_node_itself(tmp_path) -> None:
    memory = PeerMemory(tmp_path, ME, every_s=0.0)
    own = NodeInfo(ME, "data", 0, "active", 1.0, 1, maddrs=(f"/ip4/127.0.0.1/tcp/9/p2p/{ME}",))
    memory.remember(view(own, *(peer(i) for i in range(MAX_KNOWN_PEERS + 4))))
    kept = known_peers(tmp_path)
    assert len(kept) == MAX_KNOWN_PEERS and kept[0] == peer(0).maddrs[0] and ME not in "".join(kept)
    memory.remember(view(own))  # alone for now: what it knew is kept, those peers may come back
    assert known_peers(tmp_path) == kept


def test_a_peer_file_that_cannot_be_read_is_set_aside_with_one_line(tmp_path, caplog) -> None:
    path = tmp_path / PEERS_FILE
    for text in ("{not json", json.dumps({"a": 1}), json.dumps(["/ip4/1.2.3.4/tcp/99999/p2p/QmX"]), json.dumps([3])):
        path.write_text(text)
        with caplog.at_level(logging.WARNING):
            assert known_peers(tmp_path) == ()
        assert "set aside" in caplog.text and "Traceback" not in caplog.text
        caplog.clear()
    assert known_peers(tmp_path / "nothing-here") == ()


def test_a_libp2p_daemon_that_fails_to_start_is_tried_again_waiting_longer(monkeypatch, caplog) -> None:
    """The first start fails as a p2pd does on a loaded machine (it exits without a word); the second,
    a real one, runs. Three failures end in one line naming the daemon."""
    real_create, waits = P2P.create, []

    async def flaky(*args, startup_timeout: float, **kwargs):
        waits.append(startup_timeout)
        if len(waits) == 1:
            raise P2PDaemonError("Daemon failed to start: None")
        return await real_create(*args, startup_timeout=startup_timeout, **kwargs)

    async def start() -> None:
        dht = await SwarmDHT.create(load_identity(None), startup_timeout_s=20.0)
        await dht.shutdown()

    monkeypatch.setattr(P2P, "create", flaky)
    with caplog.at_level(logging.WARNING):
        asyncio.run(start())
    assert waits == [20.0, 40.0] and "did not start (Daemon failed to start: None)" in caplog.text

    async def never(*args, startup_timeout: float, **kwargs):
        waits.append(startup_timeout)
        raise P2PDaemonError(f"Daemon failed to start in {startup_timeout:.1f} seconds")

    monkeypatch.setattr(P2P, "create", never)
    waits.clear()
    with pytest.raises(UsageError, match=r"could not start the libp2p daemon in 3 tries \(the last waited 4 s\)"):
        asyncio.run(SwarmDHT.create(load_identity(None), startup_timeout_s=1.0))
    assert waits == [1.0, 2.0, 4.0] and swarm_module.LIBP2P_START_TRIES == 3


def test_a_node_given_a_dead_initial_peer_beside_a_live_one_joins_through_the_live_one() -> None:
    async def scenario() -> int:
        first = await SwarmDHT.create(load_identity(None))
        dead = "/ip4/127.0.0.1/tcp/9/p2p/QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"
        try:
            second = await SwarmDHT.create(load_identity(None), initial_peers=[dead, *await first.visible_maddrs()])
            try:
                return len(await second.p2p.list_peers())
            finally:
                await second.shutdown()
        finally:
            await first.shutdown()

    assert asyncio.run(scenario()) >= 1
