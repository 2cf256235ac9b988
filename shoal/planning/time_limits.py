"""Waits derived from what is sent: the constant a run sets is a floor, raised where the bytes at
stake take longer than it over the link a node plans for.

Reads on a stream already have a deadline per frame (shoal/p2p/streams.py), so a long transfer that
keeps moving never times out on its size. What needs a limit from its size is a wait for a whole
exchange or copy that another node makes meanwhile: an outer exchange (both sides' φ and Δ, or stage
0's gradients), on which a step close also waits, and a joiner's wait while a busy donor streams a
copy of the stage to someone else. A fault-free run at any size then waits as long as its transfers
take at the planned speed, times SLACK; a slower link than planned falls back on what the floor's
expiry does (no partner by then: a local outer step; a busy donor: ask another). The planned speed
is a fast home or campus link: the bundled toy runs' exchanges stay under their floors, a 135 M model's
do not.

    limit = wait_limit_s(10.0, n_bytes=2 * 226e6)    # 72 s: SmolLM2's embedding and head, φ and Δ in float32
"""

from __future__ import annotations

# 100 Mbit/s: the link a volunteer's node plans a whole exchange or copy on
PLANNED_LINK_BYTES_PER_S = 12_500_000
SLACK = 2.0  # a transfer may take this many times its time at the planned speed before the wait ends


def transfer_s(n_bytes: float, bytes_per_s: float = PLANNED_LINK_BYTES_PER_S) -> float:
    if n_bytes < 0 or bytes_per_s <= 0:
        raise ValueError(f"{n_bytes} bytes at {bytes_per_s} bytes/s")
    return n_bytes / bytes_per_s


def wait_limit_s(floor_s: float, n_bytes: float = 0.0, bytes_per_s: float = PLANNED_LINK_BYTES_PER_S) -> float:
    """The floor, or SLACK times `n_bytes`' transfer at `bytes_per_s`, whichever is longer."""
    return max(floor_s, SLACK * transfer_s(n_bytes, bytes_per_s))
