"""A bootstrap peer's metrics: who it is, and how many DHT peers it knows (served like a node's, node/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import InfoMetricFamily, Metric

from shoal.node.metrics import NAMESPACE, gauge

if TYPE_CHECKING:
    from shoal.bootstrap.peer import BootstrapPeer


class BootstrapCollector:
    """The few metrics of a bootstrap peer: who it is, and how many DHT peers it knows."""

    def __init__(self, peer: BootstrapPeer):
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        run = self.peer.run
        info = {"peer_id": self.peer.dht.peer_id, "role": "bootstrap", "run": run.name if run else ""}
        yield InfoMetricFamily(f"{NAMESPACE}_node", "who this peer is", value=info)
        table = self.peer.dht.node.protocol.routing_table
        yield gauge("dht_peers", "peers in this node's DHT routing table", len(table.uid_to_peer_id))
