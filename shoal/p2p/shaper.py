"""A home link in user space, for experiments: every send of this node waits as a link of a given
bandwidth and one-way latency would make it (kernel traffic shaping, netem, is not available here).

Each remote peer gets its own FIFO link: a message (a request, a reply, a tensor's header with its
first chunk) starts after the bytes queued before it to that peer have left, takes `nbytes /
bandwidth` on the wire, and arrives `latency` later; the chunks that follow a tensor's first one only
queue behind it (a link keeps its latency once, not per packet). The wait happens before the bytes
are written, so the receiver sees them when a real link of that shape would deliver them. Every node
shapes what it sends, so between two shaped nodes both directions are shaped.

    --experiment-link 100:30     # 100 Mbit/s, 30 ms each way, to every peer

benchmarks/compression.py measures a bare stream through it against the configured shape.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkShape:
    bandwidth_bytes_per_s: float
    latency_s: float

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """`MBIT:MS` (e.g. `100:30`): megabits per second and one-way milliseconds."""
        mbit, _, ms = text.partition(":")
        shape = cls(float(mbit) * 1e6 / 8, float(ms or 0) / 1e3)
        if not (shape.bandwidth_bytes_per_s > 0 and 0 <= shape.latency_s <= 10):
            raise ValueError(f"expected MBIT:MS with MBIT > 0 and 0 <= MS <= 10000, got {text!r}")
        return shape


class Shaper:
    def __init__(self, shape: LinkShape):
        self.shape = shape
        self._free_at: dict[str, float] = {}  # per peer: when the bytes already queued will have left
        self.waited_s = 0.0
        self.shaped_bytes = 0

    async def before_send(self, peer: str, nbytes: int, starts_message: bool = True) -> None:
        """Wait until `nbytes` to `peer` would arrive over the link (see the module's docstring)."""
        now = time.monotonic()
        start = max(now, self._free_at.get(peer, now))
        left = start + nbytes / self.shape.bandwidth_bytes_per_s
        self._free_at[peer] = left
        arrives = left + (self.shape.latency_s if starts_message else 0.0)
        self.shaped_bytes += nbytes
        if arrives > now:
            self.waited_s += arrives - now
            await asyncio.sleep(arrives - now)


_shaper: Shaper | None = None


def shape_links(shape: LinkShape | None) -> None:
    """Shape every send of this process from now on (None: stop shaping)."""
    global _shaper
    _shaper = Shaper(shape) if shape is not None else None


def current() -> Shaper | None:
    return _shaper
