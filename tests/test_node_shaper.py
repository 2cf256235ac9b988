"""The user-space link shaper (p2p/shaper.py): a message waits its bytes at the link's bandwidth
behind what is queued to the same peer, plus one latency; other peers have their own link.

The checks are lower bounds (a shaped send is never faster than its link) with a loose upper bound:
benchmarks/compression.py measures the shaper against the configured shape.

Run: .venv/bin/python -m pytest tests/test_node_shaper.py -q
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.p2p.shaper import LinkShape, Shaper


def test_link_shapes_parse_and_bad_ones_are_refused():
    shape = LinkShape.parse("100:30")
    assert shape.bandwidth_bytes_per_s == 12.5e6 and shape.latency_s == 0.03
    assert LinkShape.parse("8").latency_s == 0.0
    for bad in ("0:30", "-5:1", "100:-1", "fast", "100:20000"):
        with pytest.raises(ValueError):
            LinkShape.parse(bad)


def test_messages_queue_per_peer_and_pay_one_latency():
    shaper = Shaper(LinkShape(bandwidth_bytes_per_s=1e6, latency_s=0.05))

    async def main():
        started = time.monotonic()

        # 200 kB to one peer, a tensor's first chunk and then its next (as write_tensor sends them), and
        # 100 kB to another: separate links
        async def to_a():
            await shaper.before_send("a", 100_000)
            await shaper.before_send("a", 100_000, starts_message=False)

        await asyncio.gather(to_a(), shaper.before_send("b", 100_000))
        return time.monotonic() - started

    took = asyncio.run(main())
    assert 0.25 - 0.01 <= took < 1.0, took  # a's 0.2 s of bytes plus one 0.05 s latency; b's in parallel
    assert shaper.shaped_bytes == 300_000
