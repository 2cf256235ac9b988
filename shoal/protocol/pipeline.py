"""Pipeline messages: a microbatch's activation going forward, its gradient coming back.

A request is one of these headers followed by one tensor (a ``TensorHeader`` and raw chunks).
The route travels with the microbatch, so every hop knows where to send its output and where the
gradient must go back, and can re-route a hop to another replica without asking anyone.
"""

from __future__ import annotations

from .errors import MalformedMessage
from .registry import message
from .schema import wire_field

MAX_ROUTE_HOPS = 64
MAX_ID_CHARS = 96


@message("hop")
class Hop:
    stage: int
    peer_id: str = wire_field(max_len=MAX_ID_CHARS)


@message("fwd")
class ForwardRequest:
    """Run your blocks on the attached activation; `hop` is your position in `route`.

    `hop == len(route)` means the activation has come home to the data node that sent it.
    """

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS)
    origin: str = wire_field(max_len=MAX_ID_CHARS)  # the data node's peer id
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)
    needs_backward: bool = True  # False: evaluation, keep nothing


@message("bwd")
class BackwardRequest:
    """Backpropagate the attached gradient of your output; `hop == -1` means: back at the data node."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS)
    origin: str = wire_field(max_len=MAX_ID_CHARS)
    step: int
    hop: int
    route: tuple[Hop, ...] = wire_field(max_len=MAX_ROUTE_HOPS)


@message("abandon")
class AbandonNotice:
    """Tells a data node that one of its microbatches cannot finish, and why."""

    microbatch_id: str = wire_field(max_len=MAX_ID_CHARS)
    reason: str = wire_field(max_len=200)


@message("ack")
class Ack:
    """The receiver took the work (or refused it: busy, wrong stage, unknown microbatch)."""

    accepted: bool
    reason: str = wire_field(max_len=200, default="")


def check_hop(request: ForwardRequest | BackwardRequest) -> None:
    """Refuse a hop index outside its route (forward: 0..len, backward: -1..len-1)."""
    low, high = (0, len(request.route)) if isinstance(request, ForwardRequest) else (-1, len(request.route) - 1)
    if not low <= request.hop <= high:
        raise MalformedMessage(f"hop {request.hop} outside a route of {len(request.route)} hops")
