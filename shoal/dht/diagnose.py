"""Why an initial peer cannot be joined, found step by step: the address, its name, TCP, the libp2p
handshake (whose key answers), and whether it speaks shoal, and which version.

A volunteer whose join fails is told, per initial peer, the first thing that went wrong and what to
check, instead of libp2p's "failed to connect to bootstrap peers". Each step runs only once the
one before it worked, so the verdict names the earliest fault.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.protocol.version import PROTOCOL_VERSION

ADDRESS = re.compile(r"^/(ip4|ip6|dns4|dns6|dns)/([^/]+)/tcp/(\d{1,5})/p2p/([1-9A-HJ-NP-Za-km-z]{32,64})$")
OK = "ok"
FORM = "/ip4|ip6|dns4|dns6/HOST/tcp/PORT/p2p/PEER_ID"


@dataclass(frozen=True)
class Verdict:
    maddr: str
    cause: str  # ok, bad address, does not resolve, refused, timed out, wrong peer, not shoal, version, handshake
    detail: str

    @property
    def ok(self) -> bool:
        return self.cause == OK

    def line(self) -> str:
        return f"{self.maddr}: {self.detail}"


def _resolve(host: str, port: int, family: str) -> list[str]:
    kind = {"ip4": socket.AF_INET, "dns4": socket.AF_INET, "ip6": socket.AF_INET6, "dns6": socket.AF_INET6}
    infos = socket.getaddrinfo(host, port, kind.get(family, socket.AF_UNSPEC), socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


async def diagnose(
    p2p: Any, maddr: str, timeout_s: float = 5.0, resolve: Callable[[str, int, str], list[str]] = _resolve
) -> Verdict:
    """The first fault found on the way to `maddr`, or `ok` with what answered; `p2p` is any libp2p
    daemon of ours (hivemind.p2p.P2P) to try the handshake and the RPCs from."""
    found = ADDRESS.match(maddr.strip())
    if found is None:
        return Verdict(maddr, "bad address", f"not a multiaddress of the form {FORM}")
    family, host, port, peer_id = found.group(1), found.group(2), int(found.group(3)), found.group(4)
    try:
        addresses = await asyncio.get_running_loop().run_in_executor(None, resolve, host, port, family)
    except (OSError, UnicodeError) as e:
        return Verdict(maddr, "does not resolve", f"{host} does not resolve ({e}): check the name")
    if not addresses:
        return Verdict(maddr, "does not resolve", f"{host} does not resolve: check the name")
    tcp = await _tcp(addresses[0], port, timeout_s)
    if tcp is not None:
        return Verdict(maddr, *tcp)
    return await _libp2p(p2p, maddr, peer_id, timeout_s)


async def _tcp(address: str, port: int, timeout_s: float) -> tuple[str, str] | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout_s)
    except ConnectionRefusedError:
        return "refused", f"TCP refused at {address}:{port}: nothing listens there (is the peer up, on that port?)"
    except TimeoutError:
        why = "check the port is open and the host is up"
        return "timed out", f"no TCP answer from {address}:{port} in {timeout_s:g} s: {why}"
    except OSError as e:
        return "refused", f"TCP to {address}:{port} failed: {e.strerror or e}"
    writer.close()
    return None


async def _libp2p(p2p: Any, maddr: str, peer_id: str, timeout_s: float) -> Verdict:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from shoal.p2p.services import NodeRpcs
    from shoal.p2p.transport import Libp2pTransport
    from shoal.protocol.messages import Ping

    target = PeerID.from_base58(peer_id)
    try:
        await asyncio.wait_for(p2p._client.connect(target, [Multiaddr(maddr.rsplit("/p2p/", 1)[0])]), timeout_s)
    except Exception as e:
        text = str(e)
        mismatch = re.search(r"peer id mismatch: expected (\S+?), but remote key matches (\S+)", text)
        if mismatch:
            there = mismatch.group(2)
            return Verdict(maddr, "wrong peer", f"connected, but the peer there is {there}, not the {peer_id} "
                                                "the address names: take the address it prints now")  # fmt: skip
        return Verdict(maddr, "handshake", f"connected over TCP, but the libp2p handshake failed ({_first(text)})")
    try:
        ping = Ping(sent_at=time.time(), nonce=0)
        pong = await NodeRpcs(Libp2pTransport(p2p)).ping(peer_id, ping, timeout_s=timeout_s)
    except Exception as e:
        if "protocols not supported" in str(e):
            return Verdict(maddr, "not shoal", "connected, but it does not speak shoal (no shoal ping: a plain "
                                               "hivemind DHT peer, or another program on that port?)")  # fmt: skip
        return Verdict(maddr, "handshake", f"connected, but its ping failed ({_first(str(e))})")
    if pong.protocol_version != PROTOCOL_VERSION:
        newer = "newer" if pong.protocol_version > PROTOCOL_VERSION else "older"
        theirs = pong.protocol_version
        return Verdict(maddr, "version", f"speaks shoal protocol {theirs}, this shoal speaks {PROTOCOL_VERSION}: "
                                         f"the peer runs a {newer} shoal; use the same release")  # fmt: skip
    return Verdict(maddr, OK, f"answers: a shoal peer ({pong.peer_state}), protocol {pong.protocol_version}")


def _first(text: str) -> str:
    return text.strip().splitlines()[-1][:160] if text.strip() else "no detail"


async def diagnose_all(maddrs: list[str], timeout_s: float = 5.0) -> list[Verdict]:
    """`diagnose` for every initial peer at once, each from a short-lived libp2p daemon of its own:
    libp2p dials a peer id at every address it knows for it, so one daemon that had reached the id
    at one address would "connect" to it at any other and hide a wrong one."""
    return list(await asyncio.gather(*(_diagnose_alone(m, timeout_s) for m in maddrs)))


async def _diagnose_alone(maddr: str, timeout_s: float) -> Verdict:
    from hivemind.p2p import P2P

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client", nat_port_map=False)
    try:
        return await diagnose(p2p, maddr, timeout_s)
    finally:
        await p2p.shutdown()
