"""Peers a node saw live, kept in its --state-dir, so that a restart can join through them when the
initial peers it was given are gone: a volunteer's restart script keeps passing the address of a
bootstrap peer that has since died, or a swarm document lists peers long stale.

The file is a hint, never trusted: each entry is parsed as a `/.../p2p/PEER_ID` multiaddress and a
file that cannot be read is set aside with one line (the node still has the initial peers it was
given). It is rewritten at most every `every_s` seconds, atomically, from the view's live nodes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from shoal.dht.swarms import valid_peer_maddr
from shoal.files import atomic_write
from shoal.planning.swarm_view import SwarmView

logger = logging.getLogger(__name__)

PEERS_FILE = "known-peers.json"
MAX_KNOWN_PEERS = 16  # enough to find one alive after a restart; few enough to dial them all quickly


def known_peers(state_dir: str | Path) -> tuple[str, ...]:
    """The peers saved in `state_dir` (none if there is no file, or it is unreadable: said once)."""
    path = Path(state_dir) / PEERS_FILE
    if not path.exists():
        return ()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, list) or not all(isinstance(e, str) and valid_peer_maddr(e) for e in entries):
            raise ValueError("not a list of /.../p2p/PEER_ID multiaddresses")
    except (OSError, ValueError) as e:
        logger.warning("%s: set aside (%s); joining through the initial peers only", path, str(e)[:120])
        return ()
    return tuple(dict.fromkeys(entries))[:MAX_KNOWN_PEERS]


class PeerMemory:
    """Writes the live peers of each view it is given to the state dir, at most every `every_s`."""

    def __init__(self, state_dir: str | Path, own_peer_id: str, every_s: float):
        self.path = Path(state_dir) / PEERS_FILE
        self.own_peer_id, self.every_s = own_peer_id, every_s
        self._written_at = -float("inf")
        self._written: tuple[str, ...] = ()

    def remember(self, view: SwarmView | None) -> None:
        if view is None or time.monotonic() - self._written_at < self.every_s:
            return
        addresses = [m for n in view.live_nodes() if n.peer_id != self.own_peer_id
                     for m in n.maddrs if valid_peer_maddr(m)]  # fmt: skip
        peers = tuple(dict.fromkeys(addresses))[:MAX_KNOWN_PEERS]
        self._written_at = time.monotonic()
        if not peers or peers == self._written:
            return  # a node alone keeps what it knew: those may come back
        try:
            atomic_write(self.path, json.dumps(list(peers)))
            self._written = peers
        except OSError as e:  # a full disk must not stop the node
            logger.warning("could not save the known peers to %s: %s", self.path, e)
