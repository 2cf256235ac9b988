"""At start, before a node claims anything: can peers dial it, and if not, go through relays.

The node asks its initial peers (and a few live nodes of the run) to dial it back (p2p/reachability.py).
When none could and relaying is allowed (`--relayed auto`, the default), it restarts its libp2p
daemon, same key and so same peer id, as a relayed node: static relays chosen from the initial peers
(bootstrap peers relay by default) and the run's reachable nodes that offer relaying
(`--relay-service`), reachability forced to private, a DHT client (peers do not route the DHT's
traffic through a relay). Its record then lists the relays it is reached through, and it takes a stage
like any node. `--relayed always` skips the check; `never` keeps the old way: an unreachable node
takes the data role, which only dials out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

from shoal.config import RunConfig
from shoal.dht.identity import Identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.config import NodeConfig
from shoal.p2p import reachability
from shoal.p2p.relay import RelayPlan, choose_relays, limits_for, relays_in
from shoal.planning.relay_limits import RelayLimits
from shoal.planning.swarm_view import SwarmView
from shoal.run_files import load_run_config

logger = logging.getLogger(__name__)

RESERVE_WAIT_S = 20.0  # for p2pd to hold a reservation and show its circuit address


def relay_service_limits(config: NodeConfig) -> RelayLimits | None:
    """The limits this node relays within (`--relay-service`), from its run file when it was given one."""
    if not config.network.relay_service:
        return None
    path = config.run.run_config_path
    return limits_for(load_run_config(path) if path else None)


def relay_candidates(view: SwarmView, initial_peers: Sequence[str]) -> list[str]:
    """The initial peers first (bootstrap peers relay by default), then the run's reachable relay nodes."""
    offered = [n for n in view.live_nodes() if n.relay_service and n.reachable]
    random.shuffle(offered)
    listed = [m if "/p2p/" in m else f"{m}/p2p/{n.peer_id}" for n in offered for m in n.maddrs]
    return [*initial_peers, *listed]


async def reach_through_relays_if_needed(
    dht: SwarmDHT, identity: Identity, initial_peers: Sequence[str], config: NodeConfig, run: RunConfig
) -> tuple[SwarmDHT, bool | None]:
    """`dht` as it is when peers can dial us (or relaying is off), else a relayed restart of it; and
    the check's verdict (None: not checked here, the stage choice checks)."""
    network = config.network
    if not network.use_relay or network.relayed == "never":
        return dht, None
    reachable: bool | None = None  # --relayed always: not checked here
    view = await dht.read_view(run)
    if network.relayed == "auto":
        askers = reachability.askers(initial_peers, [n.peer_id for n in view.live_nodes()], dht.peer_id)
        if not askers:
            return dht, None
        maddrs = await dht.visible_maddrs()
        result = await reachability.check(dht.transport, maddrs, askers)
        if result.reachable is not False and not config.experiment.unreachable:
            return dht, result.reachable
        reachable = False
    relays = choose_relays(relay_candidates(view, initial_peers), dht.peer_id)
    if not relays:  # the check at the stage choice says the rest
        logger.warning("[%s] nobody can dial this node and no relay is offered at a public address",
                       dht.peer_id[-8:])  # fmt: skip
        return dht, None
    if network.relayed == "auto":
        logger.warning("[%s] not reachable: %s", dht.peer_id[-8:], reachability.advice(maddrs, result))
    logger.info("[%s] restarting libp2p to be reached through relay(s) %s", dht.peer_id[-8:],
                ", ".join(relays))  # fmt: skip
    await dht.shutdown()
    relayed = await SwarmDHT.create(
        identity,
        initial_peers,
        network.host_maddrs,
        network.announce_maddrs,
        client_mode=True,
        relaying=RelayPlan(relays=tuple(relays)),
        join_timeout_s=network.join_timeout_s,
        check_identity=False,
    )
    deadline = time.monotonic() + RESERVE_WAIT_S
    while not relays_in(maddrs := await relayed.visible_maddrs(latest=True)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    through = relays_in(maddrs)
    if through:
        logger.info("[%s] reached through relay(s) %s", relayed.peer_id[-8:], ", ".join(r[-8:] for r in through))
    else:
        logger.warning("[%s] no relay gave a reservation in %.0f s: peers cannot dial this node", relayed.peer_id[-8:],
                       RESERVE_WAIT_S)  # fmt: skip
    return relayed, reachable
