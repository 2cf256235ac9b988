"""What a test, a chaos run or a security experiment makes a node do wrong, in one place.

The engines call these hooks at fixed points of their work (before a forward, before a gradient goes
upstream, on a step close, on what they hand to other peers); a node started without any `--inject-*`
or `--experiment-*` flag gets `Hooks.none()`, whose every hook hands back what it was given at once.
The honest path of an engine never names a fault or an attack.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.config import RunConfig

logger = logging.getLogger(__name__)

CRASH_EXIT_STATUS = 137  # as if SIGKILLed


@dataclass(frozen=True)
class Faults:
    """Fault injection for tests and chaos runs (the `--inject-*` flags; see NodeConfig)."""

    crash_at_step: int | None = None  # a worker dies when the first forward of this step reaches it
    forward_delay_s: float = 0.0  # a worker computes this much slower than it claims (every forward)
    upstream_delay: tuple[int, float] | None = None  # (step, s) a worker holds that step's gradients
    close_delay_s: float = 0.0  # a data node's step closes reach the workers this much later
    close_stall: tuple[int, float] | None = None  # (step, s) a worker's handling of that close is blocked
    copy_delay_s: float = 0.0  # a donor holds each stage copy it serves this long before sending it


class Hooks:
    """Fault injection and experiment attacks. The default does nothing."""

    def __init__(self, faults: Faults | None = None, adversary: str | None = None):
        self.faults = faults or Faults()
        self.adversary = adversary  # an EXPERIMENT: a hostile stage replica or rollout worker (shoal.adversary)
        self.stage_attack: Any = None  # shoal.adversary.stage.StageAttack, once prepared

    @classmethod
    def none(cls) -> Hooks:
        return cls()

    # ---- faults -----------------------------------------------------------------------------------

    def before_forward(self, step: int, short_id: str) -> None:
        crash_at = self.faults.crash_at_step
        if crash_at is not None and step >= crash_at:  # gone, weights and all: no goodbye, nothing saved
            logger.warning("[%s] crashing at step %d (--inject-crash-at-step)", short_id, step)
            sys.stderr.flush()
            os._exit(CRASH_EXIT_STATUS)

    async def after_forward(self) -> None:
        if self.faults.forward_delay_s:
            await asyncio.sleep(self.faults.forward_delay_s)

    async def before_upstream(self, step: int, hop: int, microbatch_id: str, upstream: str, short_id: str) -> None:
        delay = self.faults.upstream_delay
        if delay is not None and step == delay[0] and hop > 0:
            logger.warning("[%s] fault injection: holding the gradient of %s for %.1f s before passing it to %s",
                           short_id, microbatch_id, delay[1], upstream)  # fmt: skip
            await asyncio.sleep(delay[1])

    async def before_close_sent(self) -> None:
        if self.faults.close_delay_s:
            await asyncio.sleep(self.faults.close_delay_s)

    async def on_close(self, step: int, short_id: str) -> None:
        stall = self.faults.close_stall
        if stall is not None and stall[0] == step:
            logger.warning("[%s] fault injection: handling the close of step %d is blocked %.0f s in a thread",
                           short_id, step, stall[1])  # fmt: skip
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, stall[1])

    # ---- a hostile stage replica (experiments) ----------------------------------------------------

    async def prepare_stage_attack(
        self,
        run: RunConfig,
        stage: int,
        peer_id: str,
        bound: float,
        compute: Callable[..., Awaitable[Any]],
    ) -> bool:
        """With `--experiment-adversary` naming a stage attack, become that hostile replica (the
        backdoor learns its direction first, through `compute`); whether this node is one."""
        if self.adversary is None or self.stage_attack is not None:
            return self.stage_attack is not None
        from shoal.adversary.stage import STAGE_ATTACKS, make_stage_attack
        from shoal.model.corpus import cache_dir

        if self.adversary not in STAGE_ATTACKS:
            return False
        self.stage_attack = await compute(make_stage_attack, self.adversary, run, stage, peer_id, cache_dir(), bound)
        return True

    @property
    def stage_attack_name(self) -> str | None:
        return None if self.stage_attack is None else self.stage_attack.name

    @property
    def alters_weights(self) -> bool:
        return self.stage_attack is not None

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.stage_attack is None else self.stage_attack.activation(y)

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.stage_attack is None else self.stage_attack.gradient(grad)

    def outer(self, phi: list[torch.Tensor], delta: list[torch.Tensor]) -> tuple[list, list]:
        return (phi, delta) if self.stage_attack is None else self.stage_attack.outer(phi, delta)

    def after_step(self, params: list[torch.Tensor], step: int) -> None:
        if self.stage_attack is not None:
            self.stage_attack.after_step(params, step)
