"""What a node writes about itself for whoever runs it: the ready file a launcher waits for (where it
listens, which stage it took), and the stats file (its counters, traffic and memory) at exit."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from typing import Any

import torch

from shoal.device import peak_memory_bytes, resident_bytes
from shoal.files import atomic_write
from shoal.node.engine import Engine
from shoal.p2p.streams import WIRE_BYTES

MEMORY_SAMPLE_S = 2.0
MAX_MEMORY_SAMPLES = 4000


class MemorySampler:
    """The process's resident memory every MEMORY_SAMPLE_S, the last MAX_MEMORY_SAMPLES of it."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append((time.monotonic(), resident_bytes()))
            del self.samples[:-MAX_MEMORY_SAMPLES]
            await asyncio.sleep(MEMORY_SAMPLE_S)

    def as_list(self) -> list[list[float]]:
        """[[seconds since the first sample, bytes], ...]"""
        first = self.samples[0][0] if self.samples else 0.0
        return [[round(t - first, 2), rss] for t, rss in self.samples]


def write_ready_file(path: str | None, peer_id: str, maddrs: list[str], stage: int | None, role: str, run_id: str,
                     metrics_port: int | None) -> None:  # fmt: skip
    if not path:
        return
    ready = {"peer_id": peer_id, "maddrs": maddrs, "stage": stage, "role": role, "run_id": run_id,
             "pid": os.getpid(), "metrics_port": metrics_port}  # fmt: skip
    atomic_write(path, json.dumps(ready))


def node_stats(own: dict[str, Any], engine: Engine | None, device: torch.device, memory: MemorySampler) -> dict:
    """The stats file: the node's `own` fields, then its memory, traffic and engine counters."""
    return {
        **own,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": str(device),
        "device_peak_bytes": peak_memory_bytes(device),  # torch's on an accelerator, the RSS peak on a CPU
        "rss_samples": memory.as_list(),
        "traffic": engine.traffic_counts() if engine else {},
        "wire_bytes": WIRE_BYTES.counts(),  # sent, by kind (p2p/streams.py)
        "engine": engine.stats() if engine else {},
    }
