"""Being reached through a relay, and relaying for others: libp2p circuit relay v2, as p2pd serves it.

A node nobody can dial (behind a home router, no port forwarded) reserves a slot on a few reachable
peers that relay: the bootstrap peers by default, and any node started with `--relay-service`. Its
addresses then include `/ip4/RELAY/tcp/PORT/p2p/RELAY_ID/p2p-circuit/p2p/OWN_ID`, which libp2p
dials like any other; a peer it has already dialed itself reuses that connection either way. The
relays are given to p2pd as static relays (`-trustedRelays`, `-relayDiscovery=0`): it reserves at
once instead of after autorelay's three-minute boot delay, it keeps reservations on two of them, and
when one dies it reserves on the next. It runs with its reachability forced to private, since our own
self-check (reachability.py) already found that nobody can dial it.

p2pd (hivemind 1.1.12's build) offers no hole punching (DCUtR): a relayed connection stays relayed.
Upgrading it would take a p2pd built with go-libp2p's `EnableHolePunching()` and a flag for it.

go-libp2p builds circuit addresses only from a relay's public addresses: a relay at a private
address (10/8, 192.168/16, ...) gives a NAT'd node no circuit address at all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.config import RunConfig
from shoal.planning.relay_limits import RelayLimits, relay_limits

CIRCUIT = "/p2p-circuit"
FLOAT_BYTES = 4
MAX_RELAYS = 3  # static relays given to p2pd: it holds reservations on two, the third stands by


def limits_for(run: RunConfig | None) -> RelayLimits:
    """What one pair of the run's nodes can exchange in the whole run (relay_limits.py): every
    microbatch's activations or their gradients at float32, and the whole model for each outer
    exchange and one stage copy."""
    if run is None:
        return relay_limits()
    train, model = run.train, run.model
    hop = FLOAT_BYTES * train.microbatch_size * train.seq_len * model.d_model
    outer_exchanges = train.steps // max(1, run.averaging.inner_steps) + 1
    return relay_limits(hop * run.microbatches_per_step * train.steps, FLOAT_BYTES * model.params() * outer_exchanges)


def is_circuit(maddr: str) -> bool:
    return CIRCUIT in maddr


def relay_of(maddr: str) -> str | None:
    """The relay's peer id in a circuit address, None for a direct one."""
    if not is_circuit(maddr):
        return None
    before = maddr.split(CIRCUIT, 1)[0]
    return before.rsplit("/p2p/", 1)[1] if "/p2p/" in before else None


def relays_in(maddrs: Iterable[str]) -> tuple[str, ...]:
    """The relays a node's addresses go through, each once, in order."""
    return tuple(dict.fromkeys(r for r in map(relay_of, maddrs) if r is not None))


def _is_public(maddr: str) -> bool:
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        address = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    return address.is_global or not (address.is_private or address.is_loopback or address.is_link_local)


def choose_relays(candidates: Sequence[str], own_peer_id: str, limit: int = MAX_RELAYS) -> list[str]:
    """Up to `limit` relays, one address each (`/ip4/.../tcp/PORT/p2p/ID`), in the candidates' order: the
    first public TCP address of each distinct peer, never ourselves."""
    chosen: dict[str, str] = {}
    for maddr in candidates:
        if is_circuit(maddr) or "/p2p/" not in maddr or "/tcp/" not in maddr or not _is_public(maddr):
            continue
        peer = maddr.rsplit("/p2p/", 1)[1]
        if peer != own_peer_id and peer not in chosen:
            chosen[peer] = maddr
    return list(chosen.values())[:limit]


@dataclass(frozen=True)
class RelayPlan:
    """How one node's libp2p daemon takes part in relaying."""

    relays: tuple[str, ...] = ()  # reached through these relays (full addresses); (): dialed directly
    serve: RelayLimits | None = None  # relays for others within these limits; None: not a relay

    def p2p_options(self) -> dict[str, Any]:
        """Keyword arguments of hivemind's `P2P.create`."""
        if not self.relays:
            return {"use_auto_relay": False}
        return {"use_auto_relay": True, "force_reachability": "private", "trusted_relays": list(self.relays)}

    def p2pd_flags(self) -> dict[str, str]:
        """p2pd flags `P2P.create` has no argument for."""
        flags = {"relayService": "1" if self.serve is not None else "0"}
        if self.relays:
            flags["relayDiscovery"] = "0"  # the static relays only: reserve now, not after a boot delay
        if self.serve is not None:
            flags.update(self.serve.p2pd_flags())
        return flags
