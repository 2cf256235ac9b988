"""What this machine can give the run: measured forward+backward speed, and in-flight memory."""

from __future__ import annotations

import os
import statistics
import time

import torch

from shoal.config import RunConfig
from shoal.model.llama import BlockStage

MEMORY_SHARE = 0.25  # of the memory available now, what in-flight activations may take
MAX_INFLIGHT_CAP = 256


def measure_block_throughput(run: RunConfig, repeats: int = 5, window_s: float = 0.25, most: int = 50) -> float:
    """Microbatches x blocks per second of forward+backward: one block, one microbatch.

    Passes are timed for at least `window_s` (at least `repeats` passes, at most `most`), and the
    speed is that of the faster quartile's edge. Nodes that start together measure while the others
    import and measure too: the median of five quick passes read 154-944 blocks/s on the same 2 cores,
    and routing and stage choice weigh replicas by it. A burst slows a few passes of a longer window;
    a machine busy all along slows them all, and the measure still says so."""
    m, t = run.model, run.train
    stage = BlockStage(m, range(0, 1), seed=run.train.seed)
    x = torch.randn(t.microbatch_size, t.seq_len, m.d_model)
    timings: list[float] = []
    first = time.perf_counter()
    while len(timings) < most and (len(timings) < repeats or time.perf_counter() - first < window_s):
        started = time.perf_counter()
        x_in = x.detach().requires_grad_(True)
        stage(x_in).backward(torch.ones_like(x))
        timings.append(time.perf_counter() - started)
    timings = timings[1:]  # the first pass warms up allocators and kernels
    return 1.0 / statistics.quantiles(timings, n=4)[0]


def activation_bytes_per_block(run: RunConfig) -> int:
    """An upper estimate of what backward keeps per block for one microbatch (float32)."""
    m, t = run.model, run.train
    tokens = t.microbatch_size * t.seq_len
    per_token = 12 * m.d_model + 4 * m.ffn_hidden  # norms, q/k/v, attention out, residuals, SwiGLU
    attention = t.microbatch_size * m.n_heads * t.seq_len * t.seq_len  # attention weights, math kernel
    return 4 * (tokens * per_token + attention)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def inflight_budget(run: RunConfig, blocks: int) -> int:
    per_microbatch = max(1, activation_bytes_per_block(run) * max(1, blocks))
    return max(1, min(MAX_INFLIGHT_CAP, int(available_memory_bytes() * MEMORY_SHARE) // per_microbatch))
