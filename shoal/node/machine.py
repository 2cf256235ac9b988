"""This machine as a node plans on it: where it computes and in which precision, the memory it gives its
stage, and how fast a transformer block runs there (measured once at start, capacity.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.config import RunConfig
from shoal.device import DeviceInfo, autocast_dtype, describe
from shoal.node import capacity
from shoal.planning.memory import gib


@dataclass(frozen=True)
class Machine:
    device: torch.device
    info: DeviceInfo  # the device as it was at start
    compute_dtype: torch.dtype | None  # autocast's dtype there (None: float32)
    memory_bytes: int  # what this node plans its stage in: its device's free memory at start, or --memory-limit
    memory_limit_gib: float | None  # --memory-limit, if given
    block_throughput: float  # microbatches x blocks per second of forward+backward (0: a rollout worker)

    @classmethod
    def at_start(
        cls, run: RunConfig, device: torch.device, block_throughput: float, memory_limit_gib: float | None
    ) -> Machine:
        info = describe(device)
        return cls(
            device=device,
            info=info,
            compute_dtype=autocast_dtype(device, run.pipeline.compute_dtype),
            memory_bytes=capacity.memory_for_stages(info, memory_limit_gib),
            memory_limit_gib=memory_limit_gib,
            block_throughput=block_throughput,
        )

    @property
    def limited(self) -> str:
        """What a refusal adds when --memory-limit set the memory it speaks of."""
        return "" if self.memory_limit_gib is None else " (--memory-limit)"

    def describe(self, run: RunConfig) -> str:
        """One line on where this node computes, for its log at start."""
        info = self.info
        precision = "bf16 autocast" if self.compute_dtype == torch.bfloat16 else "float32"
        limit = "" if self.memory_limit_gib is None else f", --memory-limit {gib(self.memory_bytes)}"
        speed = capacity.tokens_per_s(run, self.block_throughput)
        return (f"computing on {self.device} ({info.name}: {gib(info.total_bytes)}, {gib(info.free_bytes)} free"
                f"{limit}) in {precision}, {speed:,.0f} tokens/s through a block")  # fmt: skip
