"""Routes for the daemon's microbatches: one live replica per block stage, chosen by capacity.

A replica's expected wait is (microbatches we already have in flight on it + 1) / its throughput,
so load spreads over replicas in proportion to their speed and a slow peer is not piled on.
Peers that just failed us are passed in `exclude` and skipped. Later policies (GWTF flows, NoLoCo
random mixing, SkipPipe paths) replace `choose_route` behind the same inputs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from shoal.planning.swarm_view import STATE_ACTIVE, NodeInfo, PeerID, StageIndex, SwarmView

Route = tuple[tuple[StageIndex, PeerID], ...]


def pick_replica(
    view: SwarmView, stage: StageIndex, load: Mapping[PeerID, int], exclude: Collection[PeerID] = ()
) -> NodeInfo | None:
    candidates = [n for n in view.replicas(stage) if n.state == STATE_ACTIVE and n.peer_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda n: ((load.get(n.peer_id, 0) + 1) / max(n.block_throughput, 1e-9), n.peer_id))


def choose_route(
    view: SwarmView, order: Sequence[StageIndex], load: Mapping[PeerID, int], exclude: Collection[PeerID] = ()
) -> Route | None:
    """One replica per stage of `order` (the full pipeline is 1..S-1), or None if a stage has none."""
    route = []
    for stage in order:
        replica = pick_replica(view, stage, load, exclude)
        if replica is None:
            return None
        route.append((stage, replica.peer_id))
    return tuple(route)


def full_pipeline(view: SwarmView) -> tuple[StageIndex, ...]:
    return tuple(range(1, view.stages))
