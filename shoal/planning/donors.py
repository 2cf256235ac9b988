"""Whom a joining replica copies its stage from: the most trained donors first, and joiners that come
together spread over them instead of all streaming one replica's weights.

Replicas of a stage step together, so their inner steps are equal or a step apart; any of them is as
good a donor. Every joiner ranks the joiners of its stage it sees (its own record included) by
seniority, and starts at donor `rank mod n` of the most trained ones: two joiners that see each other
copy from different donors, and a donor serves one copy at a time where it can.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.planning.swarm_view import NodeInfo, PeerID

FRESH_STEPS = 2  # donors this close to the most trained count as equally good


def donor_order(me: PeerID, started_at: float, donors: Sequence[NodeInfo], joiners: Sequence[NodeInfo]) -> list[PeerID]:
    """`donors` (active replicas of the stage) in the order `me` (a joiner that started at `started_at`)
    should try them; `joiners`: the other joiners of the stage it sees."""
    if not donors:
        return []
    ranked = sorted(donors, key=lambda n: (-n.inner_step, n.started_at, n.peer_id))
    top = ranked[0].inner_step
    fresh = [n.peer_id for n in ranked if n.inner_step >= top - FRESH_STEPS]
    stale = [n.peer_id for n in ranked if n.inner_step < top - FRESH_STEPS]
    fresh.sort()  # every joiner rotates the same list
    seniority = {n.peer_id: (n.started_at, n.peer_id) for n in joiners} | {me: (started_at, me)}
    rank = sorted(seniority, key=seniority.__getitem__).index(me)
    start = rank % len(fresh)
    return fresh[start:] + fresh[:start] + stale
