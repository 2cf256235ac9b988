"""Can other peers open a connection to this node? A self-check at start, and the plain advice when not.

A node behind NAT or a firewall can dial out, so it joins, reads the swarm and even announces a
record; but peers that dial it (to send an activation, a gradient, a rollout bundle) fail, and the
swarm then routes work to a peer that never receives it. So a node asks a few peers to open a TCP
connection to the addresses it announces. A peer dials only addresses at the IP the request came
from (as libp2p's AutoNAT does), a few at a time with a short timeout, so the check cannot be used to
make peers scan third parties. The answer also says the IP the request was seen from, which is a
NAT'd node's public address: the advice names it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.p2p.services import NodeRpcs
from shoal.p2p.streams import FramedStream
from shoal.p2p.transport import Transport
from shoal.protocol.messages import ReachReply, ReachRequest

logger = logging.getLogger(__name__)

REACHABLE, UNREACHABLE = "reachable", "unreachable"
DIAL_TIMEOUT_S = 3.0
MAX_CONCURRENT_DIALS = 4  # per answering node: a flood of requests waits for these
ASK_PEERS = 3
ASK_TIMEOUT_S = 10.0


def tcp_address(maddr: str) -> tuple[str, int] | None:
    """(ip, port) of an /ip4|ip6/ADDR/tcp/PORT[/...] multiaddr, None for anything else (a circuit address
    through a relay among them: dialing it back would reach the relay)."""
    if "/p2p-circuit" in maddr:
        return None
    parts = maddr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ip, port = ipaddress.ip_address(parts[2]), int(parts[4])
    except ValueError:
        return None
    if (ip.version == 4) != (parts[1] == "ip4") or not 0 < port < 65536:
        return None
    return str(ip), port


async def _dial(host: str, port: int, dials: asyncio.Semaphore) -> bool:
    async with dials:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True


class ReachService:
    """The dial-back side of the check, served by every node and bootstrap peer."""

    def __init__(self) -> None:
        self.dials = asyncio.Semaphore(MAX_CONCURRENT_DIALS)

    async def reach(self, request: ReachRequest, stream: FramedStream, sender: str) -> ReachReply:
        return await answer(request, stream.remote_addr, self.dials)


async def answer(request: ReachRequest, remote_addr: str | None, dials: asyncio.Semaphore) -> ReachReply:
    """Dial back each asked address that is at the caller's own IP; say what happened to each."""
    seen = tcp_address(remote_addr) if remote_addr else None
    observed = seen[0] if seen else ""
    results = []
    for maddr in request.maddrs:
        target = tcp_address(maddr)
        if target is None:
            results.append("not checked: not an /ip4 or /ip6 TCP address")
        elif not observed or target[0] != observed:
            results.append(f"not checked: the request came from {observed or 'an unknown address'}")
        else:
            results.append(REACHABLE if await _dial(*target, dials) else UNREACHABLE)
    return ReachReply(results=tuple(results), observed=observed)


@dataclass(frozen=True)
class Reachability:
    """What the peers asked said: None when nobody could be asked (the first node of a swarm)."""

    reachable: bool | None
    asked: int
    confirmed: tuple[str, ...]  # our addresses some peer could open a connection to
    observed: tuple[str, ...]  # the IPs peers saw us come from


def verdict(maddrs: list[str], replies: list[ReachReply]) -> Reachability:
    """Reachable when any peer opened a connection to any of our addresses."""
    confirmed = sorted(
        {m for r in replies for m, result in zip(maddrs, r.results, strict=False) if result == REACHABLE}
    )
    observed = sorted({r.observed for r in replies if r.observed})
    if not replies:
        return Reachability(None, 0, (), tuple(observed))
    return Reachability(bool(confirmed), len(replies), tuple(confirmed), tuple(observed))


def advice(maddrs: list[str], result: Reachability) -> str:
    """One line for a node nobody could reach: what is wrong and the fixes, with its own port and IP."""
    ports = sorted({a[1] for a in map(tcp_address, maddrs) if a is not None})
    port = str(ports[0]) if ports else "PORT"
    public = next((ip for ip in result.observed if not ipaddress.ip_address(ip).is_private), None)
    announce = f"/ip4/{public or 'PUBLIC_IP'}/tcp/{port}"
    return (
        f"{result.asked} peer(s) could not open a connection to this node at {', '.join(maddrs) or 'any address'}: "
        f"peers will fail to send it work. Fix: forward TCP port {port} to this machine and pass "
        f"--host-maddrs /ip4/0.0.0.0/tcp/{port} --announce-maddrs {announce}; or let it be reached "
        "through a relay peer (--relayed auto, the default, when the swarm has one)"
    )


def askers(initial_peers: Sequence[str], live: Sequence[str], own_peer_id: str) -> list[str]:
    """Whom to ask: the initial peers (their ids from their addresses), then live nodes in random order."""
    initial = [m.rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in m]
    return list(dict.fromkeys(p for p in [*initial, *random.sample(list(live), len(live))] if p != own_peer_id))


async def check(transport: Transport, maddrs: list[str], peers: list[str]) -> Reachability:
    """Ask `peers` (at most ASK_PEERS, in order) to dial our TCP addresses back; the first that could
    settles it, else every answer is waited for."""
    asked = [m for m in maddrs if tcp_address(m) is not None][:4]
    request = ReachRequest(maddrs=tuple(asked))
    stub = NodeRpcs(transport)

    async def ask(peer: str) -> ReachReply | None:
        try:
            return await stub.reach(peer, request, timeout_s=ASK_TIMEOUT_S)
        except Exception as e:
            logger.info("reachability: %s did not answer: %r", peer[-8:], e)
            return None

    # one peer that could connect settles it: a busy peer's slow answer does not hold the start up
    replies: list[ReachReply] = []
    pending = {asyncio.ensure_future(ask(peer)) for peer in peers[:ASK_PEERS]}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            replies += [r for r in (task.result() for task in done) if r is not None]
            if verdict(asked, replies).reachable:
                break
    finally:
        for task in pending:
            task.cancel()
    return verdict(asked, replies)
