"""`shoal doctor --swarm NAME` (or `--initial-peers MADDR ...`): what is at each initial peer, step by step
(its name, TCP, the libp2p handshake, the shoal ping and version), one line each; then the
reachability self-check: can the peers that answered open a connection back to this machine at
`--host-maddrs` (or `--announce-maddrs`), and if not, what to forward. Exit 0 if every peer answers as
a shoal peer of this version and the check did not fail, else 2. The same diagnosis a node prints
when its join fails."""

from __future__ import annotations

import argparse
import sys

from shoal.errors import UsageError

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="the addresses to look at")
    parser.add_argument("--swarm", default=None, metavar="NAME", help="or the initial peers of this swarm")
    parser.add_argument("--swarms", nargs="+", default=[], metavar="FILE",
                        help="swarm files to read besides shoal's own and ~/.config/shoal/swarms.d/")  # fmt: skip
    parser.add_argument("--host-maddrs", nargs="+", default=[LOOPBACK], metavar="MADDR",
                        help="where a node here would listen, for the self-check (default: loopback)")  # fmt: skip
    parser.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                        help="the addresses it would announce (behind NAT or port forwarding)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="per step (default 5)")


async def self_check(peers: list[str], host_maddrs: list[str], announce_maddrs: list[str], timeout_s: float) -> str:
    """One line: whether `peers` (multiaddresses of shoal peers that answered) could dial this machine
    back at the addresses a node with these flags would announce, and the fix when not."""
    import asyncio

    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from shoal.p2p import reachability
    from shoal.p2p.transport import Libp2pTransport

    try:
        p2p = await P2P.create(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs or None, dht_mode="client",
                               nat_port_map=False)  # fmt: skip
    except Exception as e:
        return f"FAIL  cannot listen at {' '.join(host_maddrs)}: {str(e).splitlines()[-1][:160]}"
    try:
        ids = []
        for maddr in peers:
            address, _, peer_id = maddr.rpartition("/p2p/")
            try:
                await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), [Multiaddr(address)]),
                                       timeout_s)  # fmt: skip
            except Exception:  # it answered the diagnosis a moment ago: leave it out of the self-check
                continue
            ids.append(peer_id)
        if not ids:
            return "-     reachability not checked: no peer could be reached again for the self-check"
        ours = [str(m) for m in await p2p.get_visible_maddrs()]
        result = await reachability.check(Libp2pTransport(p2p), ours, ids)
    finally:
        await p2p.shutdown()
    if result.reachable:
        where = ", ".join(result.confirmed)
        return f"ok    reachable: {result.asked} peer(s) asked, they opened a connection to {where}"
    if result.reachable is None:
        return "-     reachability not checked: none of the peers answered the request"
    return f"FAIL  not reachable: {reachability.advice(ours, result)}"


def run(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.dht.diagnose import diagnose_all
    from shoal.dht.swarms import initial_peers_from

    peers, _ = initial_peers_from(args.initial_peers, args.swarm, args.swarms)
    if not peers:
        raise UsageError("--initial-peers MADDR or --swarm NAME is required: the addresses to look at")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")

    async def main() -> tuple[list, str]:
        verdicts = await diagnose_all(list(peers), args.timeout)
        answering = [v.maddr for v in verdicts if v.ok]
        if not answering:
            return verdicts, "-     reachability not checked: no initial peer answers as a shoal peer"
        return verdicts, await self_check(answering, args.host_maddrs, args.announce_maddrs, args.timeout)

    verdicts, reach = uvloop.run(main())
    for verdict in verdicts:
        print(("ok    " if verdict.ok else "FAIL  ") + verdict.line())
    print(reach)
    sys.stdout.flush()
    return 0 if all(v.ok for v in verdicts) and not reach.startswith("FAIL") else 2
