"""The reachability self-check: peers dial a joining node back at the addresses it announces, only at
the IP its request came from, and a node nobody can reach says so once with the fix."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shoal.p2p.reachability import REACHABLE, UNREACHABLE, Reachability, advice, answer, tcp_address, verdict
from shoal.protocol.messages import ReachReply, ReachRequest
from tests.helpers.tiny import write_tiny_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_addresses_are_parsed_and_anything_else_is_not():
    assert tcp_address("/ip4/127.0.0.1/tcp/31337/p2p/QmX") == ("127.0.0.1", 31337)
    assert tcp_address("/ip6/::1/tcp/8/") == ("::1", 8)
    for other in ("/ip4/127.0.0.1/udp/1", "/dns4/example.org/tcp/1", "/ip4/1.2.3/tcp/1", "/ip4/::1/tcp/1",
                  "/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/70000", "garbage", ""):  # fmt: skip
        assert tcp_address(other) is None, other


def test_a_peer_dials_back_only_at_the_callers_ip():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port, closed_port = server.sockets[0].getsockname()[1], free_port()
        request = ReachRequest(maddrs=(f"/ip4/127.0.0.1/tcp/{open_port}", f"/ip4/127.0.0.1/tcp/{closed_port}",
                                       "/ip4/192.0.2.7/tcp/80", "/dns4/example.org/tcp/80"))  # fmt: skip
        try:
            return await answer(request, "/ip4/127.0.0.1/tcp/40001", asyncio.Semaphore(2))
        finally:
            server.close()

    reply = asyncio.run(scenario())
    assert reply.observed == "127.0.0.1"
    assert reply.results[:2] == (REACHABLE, UNREACHABLE)
    assert reply.results[2].startswith("not checked: the request came from 127.0.0.1")  # never dialled
    assert reply.results[3].startswith("not checked: not an")


def test_the_verdict_and_the_advice():
    ours = ["/ip4/10.1.2.3/tcp/31337"]
    unreachable = verdict(ours, [ReachReply(results=(UNREACHABLE,), observed="81.2.69.160")] * 2)
    assert unreachable == Reachability(False, 2, (), ("81.2.69.160",))
    text = advice(ours, unreachable)
    assert "2 peer(s)" in text and "forward TCP port 31337" in text
    assert "--announce-maddrs /ip4/81.2.69.160/tcp/31337" in text and "--relayed auto" in text
    assert verdict(ours, [ReachReply(results=(REACHABLE,), observed="10.1.2.3")]).reachable is True
    assert verdict(ours, []).reachable is None


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_node_announcing_an_address_nobody_can_dial_says_so_and_status_shows_it(swarm, tmp_path):
    bootstrap = swarm.start_bootstrap("--run-config", str(write_tiny_run(tmp_path)))
    entry = bootstrap.maddrs[0]
    reachable = swarm.start_node([entry], "--role", "worker", "--stage", "1")
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}"
    # nobody can dial it, so it does not take a stage others must dial: it takes the data role
    hidden = swarm.start_node([entry], "--announce-maddrs", dead)
    assert hidden.stage == 0
    status = swarm.status(entry)
    by_peer = {n["peer_id"]: n for n in status["nodes"]}
    assert by_peer[reachable.peer_id]["reachable"] is True
    assert by_peer[hidden.peer_id]["reachable"] is False
    warnings = [line for line in hidden.log().splitlines() if "forward TCP port" in line]
    assert len(warnings) == 1, hidden.log()[-3000:]
    assert f"forward TCP port {dead.rsplit('/', 1)[1]}" in warnings[0] and "--announce-maddrs" in warnings[0]
    assert "not reachable: taking the data role" in hidden.log()
    assert "not reachable" not in reachable.log()
