"""Throughput from what a data node observed, not from what peers say about themselves.

A peer's record states its `block_throughput`, and routing (GWTF's flow plan, capacity routing)
sends more microbatches to faster peers: one peer that claims a huge figure would attract every
route and then stall them. A data node sees how long each microbatch's forward trip took and which
peers it went through. A trip is the sum of its hops plus costs every trip shares, so over many
trips through different replicas a least-squares fit gives each peer's hop time; the self-reported
figure is the prior, so a peer seen on few trips keeps it. Within a stage every trip has exactly
one replica, so only the differences between a stage's replicas are identifiable from trips: the
prior sets the level, the observations move a replica that is slower than its claim.

Routing then uses min(self-reported, observed): a claim is believed only as far as it is borne out,
and a peer that is faster than it says is not promoted beyond its own claim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shoal.planning.swarm_view import NodeInfo, PeerID, SwarmView

MIN_TRIPS = 4  # a peer seen on fewer trips keeps its self-reported figure
PRIOR_WEIGHT = 1.0  # how many trips' worth of evidence the prior is worth


@dataclass(frozen=True)
class Trip:
    """One microbatch's forward trip, injection to the activation coming home: its hops' peers."""

    peers: tuple[PeerID, ...]
    seconds: float


def hop_times(
    trips: Sequence[Trip], prior: Mapping[PeerID, float], stage_of: Mapping[PeerID, int]
) -> dict[PeerID, float]:
    """Each peer's hop time (s) fitted to `trips`, for the peers seen on at least MIN_TRIPS of them.

    Least squares of trip time = shared cost + sum of its hops' times, with a ridge pull of each
    peer's time toward `prior` (its self-reported hop time). A stage's level is not identifiable
    (every trip crosses the stage once), so each stage is then shifted to put the replica that best
    matches its claim at its claim: the others are slower than claimed by what the trips showed.
    Peers without a prior are not fitted."""
    counts: dict[PeerID, int] = {}
    for trip in trips:
        for peer in trip.peers:
            counts[peer] = counts.get(peer, 0) + 1
    peers = sorted(p for p, n in counts.items() if n >= MIN_TRIPS and p in prior)
    if not peers:
        return {}
    column = {p: i + 1 for i, p in enumerate(peers)}  # column 0: the cost every trip shares
    rows, targets = [], []
    for trip in trips:
        row = np.zeros(len(peers) + 1)
        row[0] = 1.0
        known = 0.0
        for peer in trip.peers:
            if peer in column:
                row[column[peer]] += 1.0
            else:
                known += prior.get(peer, 0.0)  # not fitted: take its claim as it is
        rows.append(row)
        targets.append(trip.seconds - known)
    weight = np.sqrt(PRIOR_WEIGHT)
    for p in peers:  # the prior, as extra observations of each peer alone
        row = np.zeros(len(peers) + 1)
        row[column[p]] = weight
        rows.append(row)
        targets.append(weight * prior[p])
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    fitted = {p: float(solution[column[p]]) for p in peers}
    shift: dict[int, float] = {}
    for p in peers:
        stage = stage_of[p]
        shift[stage] = min(shift.get(stage, np.inf), fitted[p] - prior[p])
    return {p: max(fitted[p] - shift[stage_of[p]], 1e-6) for p in peers}


def capped_throughput(claimed: float, claimed_hop_s: float, observed_hop_s: float | None) -> float:
    """The throughput routing uses: the claim, scaled down when the hop is observed to take longer."""
    if observed_hop_s is None or observed_hop_s <= claimed_hop_s:
        return claimed
    return claimed * claimed_hop_s / observed_hop_s


def claimed_hop_s(node: NodeInfo, blocks: int, backward_factor: float) -> float:
    """The forward time of a hop through `node` that its self-reported throughput implies."""
    return max(1, blocks) / max(node.block_throughput, 1e-9) / (1.0 + backward_factor)


def observed_view(view: SwarmView, trips: Sequence[Trip], backward_factor: float) -> SwarmView:
    """`view` with each block-stage peer's throughput capped by what `trips` showed of it."""
    workers = [n for n in view.live_nodes() if n.stage > 0]
    prior = {n.peer_id: claimed_hop_s(n, view.blocks_per_stage[n.stage], backward_factor) for n in workers}
    fitted = hop_times(trips, prior, {n.peer_id: n.stage for n in workers})
    if not fitted:
        return view
    capped = {
        n.peer_id: capped_throughput(n.block_throughput, prior[n.peer_id], fitted.get(n.peer_id)) for n in workers
    }
    return view.with_throughput(capped)
