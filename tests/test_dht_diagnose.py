"""A join that explains itself: each initial peer's fault, found for real on loopback (a closed port,
the wrong peer id, a stock hivemind DHT peer, a peer of another protocol version), one line each,
from `shoal doctor` and from a node whose join fails."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from shoal.demo.launcher import shoal_command
from shoal.dht.diagnose import diagnose, diagnose_all
from shoal.protocol.messages import Ping, Pong
from shoal.protocol.version import PROTOCOL_VERSION

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def _doctor(*maddrs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", "doctor", "--timeout", "3", "--initial-peers", *maddrs],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_doctor_names_each_peers_fault_in_one_line(swarm):
    from hivemind.dht import DHT

    entry = swarm.start_bootstrap().maddrs[0]
    stock = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # a plain hivemind DHT peer, its own process
    try:
        stock_maddr = str(stock.get_visible_maddrs()[0])
        other_id = stock_maddr.rsplit("/p2p/", 1)[1]
        wrong_id = entry.rsplit("/p2p/", 1)[0] + f"/p2p/{other_id}"
        closed = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{other_id}"
        done = _doctor(entry, wrong_id, closed, stock_maddr, "/ip4/127.0.0.1/tcp/1")
    finally:
        stock.shutdown()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 6, done.stdout
    assert lines[0].startswith(f"ok    {entry}: answers: a shoal peer (bootstrap), protocol {PROTOCOL_VERSION}")
    assert "connected, but the peer there is " in lines[1] and f"not the {other_id} the address names" in lines[1]
    assert "TCP refused at 127.0.0.1:" in lines[2] and "nothing listens there" in lines[2]
    assert "does not speak shoal" in lines[3]
    assert "not a multiaddress of the form" in lines[4]
    assert all(line.startswith("FAIL  ") for line in lines[1:5])
    assert lines[5].startswith("ok    reachable: 1 peer(s) asked, they opened a connection to /ip4/127.0.0.1/tcp/")
    ok = _doctor(entry)
    assert ok.returncode == 0 and ok.stdout.startswith("ok    "), ok.stdout


def test_doctor_says_what_to_forward_when_the_peers_cannot_dial_back(swarm):
    """The self-check's other verdicts: announced at a port where nothing listens, this machine is not
    reachable, and the doctor names the port to forward and the flags to pass; a port another program
    holds cannot be listened on; with no initial peer answering, reachability is not checked."""
    entry = swarm.start_bootstrap().maddrs[0]
    port = _closed_port()
    done = _doctor(entry, "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    first, reach = done.stdout.strip().splitlines()
    assert first.startswith(f"ok    {entry}: answers")
    assert reach.startswith("FAIL  not reachable: 1 peer(s) could not open a connection to this node")
    assert f"forward TCP port {port} to this machine" in reach and "--relayed auto" in reach
    with socket.socket() as taken:  # a port another program listens on: a node here could not listen there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = f"/ip4/127.0.0.1/tcp/{taken.getsockname()[1]}"
        busy = _doctor(entry, "--host-maddrs", held)
    assert busy.returncode == 2 and busy.stdout.strip().splitlines()[-1].startswith(f"FAIL  cannot listen at {held}: ")
    nobody = _doctor(f"/ip4/127.0.0.1/tcp/{port}/p2p/{entry.rsplit('/p2p/', 1)[1]}")
    assert nobody.returncode == 2, nobody.stdout
    last = nobody.stdout.strip().splitlines()[-1]
    assert last == "-     reachability not checked: no initial peer answers as a shoal peer", nobody.stdout


class _NewerHealth:
    """Answers shoal's ping as a peer of the next protocol version would."""

    async def ping(self, request: Ping, sender: str) -> Pong:
        return Pong(sent_at=request.sent_at, nonce=request.nonce, peer_state="active", stage=1,
                    protocol_version=PROTOCOL_VERSION + 1)  # fmt: skip


def test_a_peer_of_another_protocol_version_and_a_name_that_does_not_resolve():
    from hivemind.p2p import P2P

    from shoal.p2p.rpc import serve
    from shoal.p2p.services import NodeRpcs
    from shoal.p2p.transport import Libp2pTransport

    def no_such_name(host, port, family):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")  # no DNS query leaves the machine

    async def main():
        newer = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        try:
            await serve(Libp2pTransport(newer), NodeRpcs, {NodeRpcs.ping: _NewerHealth().ping}, who="newer")
            maddr = str((await newer.get_visible_maddrs())[0])  # with its /p2p/ part
            (version,) = await diagnose_all([maddr], timeout_s=5.0)
            named = await diagnose(None, f"/dns4/swarm.example/tcp/31337/p2p/{newer.peer_id}", resolve=no_such_name)
            return version, named
        finally:
            await newer.shutdown()

    version, named = asyncio.run(main())
    assert version.cause == "version", version
    assert f"speaks shoal protocol {PROTOCOL_VERSION + 1}, this shoal speaks {PROTOCOL_VERSION}" in version.detail
    assert "runs a newer shoal" in version.detail
    assert named.cause == "does not resolve" and "swarm.example does not resolve" in named.detail


def test_a_node_that_cannot_join_says_why_for_each_initial_peer_and_exits_2(swarm):
    entry = swarm.start_bootstrap().maddrs[0]
    peer_id = entry.rsplit("/p2p/", 1)[1]
    closed = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{peer_id}"
    started = time.monotonic()
    node = swarm.start_node([closed], "--join-timeout", "3", wait=False)
    node.process.wait(timeout=90)
    took = time.monotonic() - started
    log = node.log()
    assert node.process.returncode == 2 and "Traceback" not in log, log[-2000:]
    assert "could not join the swarm in 3 s" in log and f"{closed}: TCP refused at 127.0.0.1:" in log
    assert took < 60, took  # the retries stop at the timeout; the start-up and the diagnosis take the rest


def test_a_node_and_status_name_each_initial_peers_fault_and_exit_2(swarm):
    """What the doctor says, `shoal node` and `shoal status` say too when their join fails: here a wrong
    peer id and a peer of another protocol version, given together, one line each, exit 2; and a run
    name that a stock hivemind DHT does not publish."""
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    from shoal.p2p.rpc import serve
    from shoal.p2p.services import NodeRpcs
    from shoal.p2p.transport import Libp2pTransport

    entry = swarm.start_bootstrap().maddrs[0]
    stock = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # only lends its peer id to the wrong address

    def join(command: str, peers: list[str]) -> subprocess.CompletedProcess:
        argv = shoal_command(command, "--initial-peers", *peers, "--join-timeout", "3")
        return subprocess.run(argv, capture_output=True, text=True, timeout=180)

    async def main() -> tuple[list[str], list[subprocess.CompletedProcess]]:
        newer = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        try:
            await serve(Libp2pTransport(newer), NodeRpcs, {NodeRpcs.ping: _NewerHealth().ping}, who="newer")
            other_id = str(stock.get_visible_maddrs()[0]).rsplit("/p2p/", 1)[1]
            peers = [entry.rsplit("/p2p/", 1)[0] + f"/p2p/{other_id}", str((await newer.get_visible_maddrs())[0])]
            done = await asyncio.gather(*(asyncio.to_thread(join, c, peers) for c in ("node", "status")))
            return peers, list(done)
        finally:
            await newer.shutdown()

    try:
        (wrong_id, newer_maddr), done = asyncio.run(main())
        # a stock hivemind DHT is a DHT shoal can join, but no run is published there: asked for one by
        # name, the node says so in one line
        unknown = join("node", [str(stock.get_visible_maddrs()[0]), "--run", "nope"])
    finally:
        stock.shutdown()
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines()[-1] == (
        "shoal node: error: no run named 'nope' is published in this swarm (it publishes no default run)"
    ), unknown.stderr[-2000:]
    for command, result in zip(("node", "status"), done, strict=True):
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr[-2000:])
        lines = [line.strip() for line in result.stderr.strip().splitlines()[-3:]]
        assert lines[0].startswith(f"shoal {command}: error: could not join the swarm in 3 s"), (command, lines)
        assert lines[1].startswith(f"{wrong_id}: connected, but the peer there is "), (command, lines)
        assert lines[2].startswith(f"{newer_maddr}: ") and f"speaks shoal protocol {PROTOCOL_VERSION + 1}" in lines[2]


def test_a_port_that_never_answers_and_a_listener_that_is_not_libp2p():
    """The last two verdicts, staged on loopback: a listener whose accept queue is full drops further
    SYNs, so TCP times out; a listener that answers with plain text fails the libp2p handshake."""
    peer_id = "QmYM95Q9etkUisXP2sLGTeighcWUkvnsgVYxM3S8PdA7DB"

    async def main():
        full = socket.socket()
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = []
        for _ in range(4):  # fill the accept queue: nobody accepts, and the next SYN is dropped
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(full.getsockname())
            except BlockingIOError:
                pass
            queued.append(s)
        await asyncio.sleep(0.2)

        async def chatter(reader, writer):
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(chatter, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            silent = await diagnose(None, f"/ip4/127.0.0.1/tcp/{full.getsockname()[1]}/p2p/{peer_id}", timeout_s=1.0)
            (other,) = await diagnose_all([f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"], timeout_s=3.0)
        finally:
            server.close()
            for s in (full, *queued):
                s.close()
        return silent, other

    silent, other = asyncio.run(main())
    assert silent.cause == "timed out" and "check the port is open and the host is up" in silent.detail, silent
    assert other.cause == "handshake" and "the libp2p handshake failed" in other.detail, other
