"""`shoal health`: ping one node over libp2p with its health RPC; exit 0 if it answers, 1 if not.

shoal health --peer /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo...
shoal health --ready-file /data/ready.json     # the file `shoal node --ready-file` writes

It prints one line either way, so it fits a container's HEALTHCHECK. It starts a libp2p daemon of
its own (client mode, loopback), dials the node and sends the Ping every daemon serves; a node
that answers and is not leaving is healthy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shoal.errors import UsageError

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--peer", metavar="MADDR", help="the node's address, ending in /p2p/PEER_ID")
    target.add_argument(
        "--ready-file", metavar="PATH", help="or the ready file the node writes (`shoal node --ready-file PATH`)"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the answer")


def loopback_variant(maddr: str) -> str | None:
    """The same port on 127.0.0.1: a node in a container announces its public or container address,
    which the container itself may not reach (no hairpin NAT), but it always listens on loopback
    when it listens on 0.0.0.0 (the image's default)."""
    parts = maddr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] == "tcp":
        return "/".join(["", "ip4", "127.0.0.1", *parts[3:]])
    return None


def targets(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The peer id to ping and the addresses to dial it at."""
    if args.peer:
        peer_id = args.peer.rstrip("/").rsplit("/p2p/", 1)[-1] if "/p2p/" in args.peer else ""
        if not peer_id or "/" in peer_id:
            raise UsageError(f"--peer {args.peer}: the address must end in /p2p/PEER_ID")
        return peer_id, [args.peer]
    path = Path(args.ready_file)
    try:
        info = json.loads(path.read_text())
        peer_id, maddrs = str(info["peer_id"]), [str(m) for m in info["maddrs"]]
    except FileNotFoundError:
        raise Unhealthy(f"no ready file at {path}: the node has not become active (yet)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Unhealthy(f"unreadable ready file {path}: {type(e).__name__} {e}") from None
    full = [m if "/p2p/" in m else f"{m}/p2p/{peer_id}" for m in maddrs]
    loopback = [v for v in map(loopback_variant, full) if v is not None]
    return peer_id, list(dict.fromkeys(loopback + full))


class Unhealthy(Exception):
    """The one line that says why the node is not healthy."""


async def ping(peer_id: str, maddrs: list[str], timeout_s: float) -> str:
    """The healthy line, or Unhealthy with the reason."""
    import secrets

    from hivemind.p2p import P2P

    from shoal.p2p.services import NodeRpcs
    from shoal.p2p.transport import Libp2pTransport
    from shoal.protocol.messages import Ping
    from shoal.protocol.version import PROTOCOL_VERSION

    deadline = time.monotonic() + timeout_s
    try:
        p2p = await P2P.create(
            initial_peers=maddrs,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            dht_mode="client",
            nat_port_map=False,
            startup_timeout=timeout_s,
        )
    except Exception as e:
        reason = "cannot connect" if "bootstrap" in str(e) else f"{type(e).__name__}: {e}"
        raise Unhealthy(f"no answer from {', '.join(maddrs)} ({reason})") from None
    try:
        nonce = secrets.randbits(63)
        started = time.monotonic()
        try:
            ping = Ping(sent_at=time.time(), nonce=nonce)
            pong = await NodeRpcs(Libp2pTransport(p2p)).ping(peer_id, ping, max(1.0, deadline - started))
        except Exception as e:
            raise Unhealthy(f"node …{peer_id[-8:]} did not answer its health RPC ({type(e).__name__} {e})") from None
        rtt_ms = (time.monotonic() - started) * 1000
    finally:
        await p2p.shutdown()
    if pong.nonce != nonce:
        raise Unhealthy(f"node …{peer_id[-8:]} answered another ping (nonce {pong.nonce}, sent {nonce})")
    holds = f"stage {pong.stage}" if pong.stage >= 0 else "no stage yet"
    line = f"node …{peer_id[-8:]} is {pong.peer_state}, {holds}, protocol {pong.protocol_version}"
    if pong.peer_state == "leaving":
        raise Unhealthy(line)
    if pong.protocol_version != PROTOCOL_VERSION:
        line += f" (this shoal speaks {PROTOCOL_VERSION})"
    return f"{line}; answered in {rtt_ms:.0f} ms"


def run(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # the one line below says what went wrong
    try:
        peer_id, maddrs = targets(args)
        line = uvloop.run(ping(peer_id, maddrs, args.timeout))
    except Unhealthy as e:
        print(f"unhealthy: {e}", file=sys.stderr, flush=True)
        return EXIT_UNHEALTHY
    print(f"healthy: {line}", flush=True)
    return EXIT_HEALTHY
