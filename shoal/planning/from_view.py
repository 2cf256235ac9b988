"""The daemon's bridge: a planning `Swarm` from its `SwarmView` plus the links it has measured.

The view says who serves which stage, how fast and with how much memory; the planners also need
latency and bandwidth, which a node measures for the peers it talks to. Each peer becomes its own
site, so a view of a few hundred peers costs a table of that size squared. Pairs nobody measured
get stated defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.planning.costs import CostModel
from shoal.planning.swarm import NodeId, PlanNode, Swarm
from shoal.planning.swarm_view import PeerID, SwarmView

DEFAULT_LATENCY_S = 0.1  # an unmeasured pair: a transatlantic round trip's worth, one way
DEFAULT_BANDWIDTH_BPS = 12.5e6  # an unmeasured pair: 100 Mbit/s
SAME_PEER_BANDWIDTH_BPS = 1e12


def swarm_from_view(
    view: SwarmView,
    cost: CostModel,
    links: Mapping[tuple[PeerID, PeerID], tuple[float, float]] | None = None,
    default_latency_s: float = DEFAULT_LATENCY_S,
    default_bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS,
    node_ids: Mapping[PeerID, NodeId] | None = None,
) -> tuple[Swarm, dict[PeerID, NodeId]]:
    """(swarm, peer id -> node id) over the view's live peers; `links` maps (from, to) to
    (one-way latency s, bandwidth B/s), and a pair measured one way only is taken as symmetric.
    `node_ids` keeps node ids stable across views (a caller whose plans outlive one view needs
    that); by default a peer's id is its index in peer-id order.

    A peer's `block_throughput` counts blocks x microbatches per second of forward plus backward, so
    its stage's forward takes blocks / throughput / (1 + backward factor); a data node (no blocks)
    is costed as one block.
    """
    links = links or {}
    peers = sorted(view.live_nodes(), key=lambda n: n.peer_id)
    ids = {n.peer_id: i for i, n in enumerate(peers)}  # site indices
    nodes = []
    for n in peers:
        blocks = max(1, view.blocks_per_stage[n.stage])
        forward = blocks / max(n.block_throughput, 1e-9) / (1.0 + cost.backward_factor)
        node_id = ids[n.peer_id] if node_ids is None else node_ids[n.peer_id]
        nodes.append(PlanNode(node_id, n.stage, ids[n.peer_id], forward, max(1, n.max_inflight)))
    lat = [[default_latency_s] * len(peers) for _ in peers]
    bw = [[default_bandwidth_Bps] * len(peers) for _ in peers]
    for i in range(len(peers)):
        lat[i][i], bw[i][i] = 0.0, SAME_PEER_BANDWIDTH_BPS
    for (a, b), (latency, bandwidth) in links.items():
        if a in ids and b in ids and a != b:
            i, j = ids[a], ids[b]
            bandwidth = bandwidth if bandwidth and bandwidth > 0 else default_bandwidth_Bps  # 0: not measured
            lat[i][j], bw[i][j] = latency, bandwidth
            if (b, a) not in links:
                lat[j][i], bw[j][i] = latency, bandwidth
    swarm = Swarm(
        tuple(nodes),
        view.stages,
        tuple(tuple(r) for r in lat),
        tuple(tuple(r) for r in bw),
        tuple(n.peer_id for n in peers),
    )
    return swarm, ids if node_ids is None else {n.peer_id: node_ids[n.peer_id] for n in peers}
