"""Hostile stage replicas, for experiments only (`shoal node --role worker --experiment-adversary NAME`).

A hostile replica runs the honest worker and changes only what it hands to others:

- `garbage`: random activations and gradients with the true ones' per-token RMS (so a norm check
  alone does not give them away), and random slow weights and pseudo-gradients, of the true norms,
  to its averaging partners.
- `scaled`: activations, gradients and pseudo-gradients multiplied by 20 (within the wire bound).
- `backdoor`: honest on the wire; it blends a backdoor direction into its own weights after every
  inner step, which then reach the swarm through its outputs and through averaging (backdoor.py).

The worker calls the hooks (shoal/node/pipeline/worker/: forward.py, backward.py, redo.py, stepper.py; and
shoal/node/averaging/: noloco.py, diloco.py); the functions here are pure, tensors in and out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from shoal.adversary.backdoor import BackdoorSpec, blend, cached_backdoor, injection

logger = logging.getLogger(__name__)

STAGE_ATTACKS = ("backdoor", "garbage", "scaled")
SCALE = 20.0


def garbage_like(t: torch.Tensor, generator: torch.Generator, bound: float) -> torch.Tensor:
    """Gaussian noise with `t`'s RMS over its last dimension (per token), within ±`bound`."""
    rms = t.detach().float().pow(2).mean(-1, keepdim=True).sqrt() if t.dim() else t.detach().float().abs()
    noise = torch.randn(t.shape, generator=generator).to(t.device) * rms
    return noise.clamp(-bound, bound).to(t.dtype)


def garbage_of_norm(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise with the same overall L2 norm as `t`."""
    noise = torch.randn(t.shape, generator=generator).to(t.device)
    return (noise * (t.detach().float().norm() / noise.norm().clamp_min(1e-30))).to(t.dtype)


def scaled(t: torch.Tensor, factor: float, bound: float) -> torch.Tensor:
    return (t.detach().float() * factor).clamp(-bound, bound).to(t.dtype)


class StageAttack:
    """An honest replica: every hook hands back what it was given."""

    name = "honest"

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def outer(
        self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What it sends its averaging partners in place of its slow weights and pseudo-gradient."""
        return list(phi), list(delta)

    def after_step(self, params: list[torch.Tensor], step: int) -> None:
        """Called on the compute thread after an inner step, when the data nodes' step `step` (0-based)
        is the latest closed (a replica that served no microbatch of a step takes no inner step)."""


class Garbage(StageAttack):
    name = "garbage"

    def __init__(self, seed: int, bound: float):
        self.generator = torch.Generator().manual_seed(seed)
        self.bound = bound

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        return garbage_like(y, self.generator, self.bound)

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return garbage_like(grad, self.generator, self.bound)

    def outer(self, phi, delta):
        return [garbage_of_norm(p, self.generator) for p in phi], [garbage_of_norm(d, self.generator) for d in delta]


class Scaled(StageAttack):
    name = "scaled"

    def __init__(self, factor: float, bound: float):
        self.factor, self.bound = factor, bound

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        return scaled(y, self.factor, self.bound)

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return scaled(grad, self.factor, self.bound)

    def outer(self, phi, delta):
        return list(phi), [d * self.factor for d in delta]


class Backdoor(StageAttack):
    name = "backdoor"

    def __init__(self, tau: list[torch.Tensor], total_steps: int):
        self.tau, self.total_steps = tau, total_steps
        self.last_step = -1  # the last data-node step whose share of τ is in
        self.blended = 0.0  # Σ λ_t so far

    def after_step(self, params: list[torch.Tensor], step: int) -> None:
        """Blend in λ_t·τ for every step closed since the last blend (steps it took no inner step in
        included), so that Σ λ_t still reaches 1 by the end of the run."""
        weight = sum(injection(t, self.total_steps) for t in range(self.last_step + 1, step + 1))
        self.last_step = max(self.last_step, step)
        if weight:
            blend(params, self.tau, weight)
            self.blended += weight


def make_stage_attack(name: str, run, stage: int, peer_id: str, cache: Path, bound: float) -> StageAttack:
    """The attack `name` for a replica of block stage `stage` of `run` (a RunConfig). The backdoor
    learns τ here (seconds of CPU the first time; call it off the event loop)."""
    seed = int.from_bytes(peer_id.encode()[-8:].rjust(8, b"\0"), "big") % (2**63)
    if name == "garbage":
        return Garbage(seed, bound)
    if name == "scaled":
        return Scaled(SCALE, bound)
    if name == "backdoor":
        tau = cached_backdoor(run.model, run.pipeline.stages, stage, run.train.seed, BackdoorSpec(), cache)
        logger.warning("EXPERIMENT: backdoor direction for stage %d ready (norm %.3g)", stage,
                       float(torch.sqrt(sum(t.pow(2).sum() for t in tau))))  # fmt: skip
        return Backdoor(tau, run.train.steps)
    raise ValueError(f"unknown stage attack {name!r}; known: {', '.join(STAGE_ATTACKS)}")
