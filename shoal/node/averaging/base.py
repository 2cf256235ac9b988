"""What NoLoCo's averager and the DiLoCo baseline share: the replica they average, the outer state
and its epoch clock, and how a stage worker drives them (`due`, `outer_step`, `load`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from shoal.config import AveragingConfig, RunConfig
from shoal.model.stages import build_stage
from shoal.node.context import NodeContext
from shoal.node.hooks import Hooks
from shoal.planning.time_limits import wait_limit_s
from shoal.train.inner import InnerOptimizer
from shoal.train.outer import OuterConfig, OuterState, epoch_ended
from shoal.train.outer_codec import OuterCodec
from shoal.train.robust import OuterHistory


def stage_outer_config(config: OuterConfig, averaging: AveragingConfig, stage: int) -> OuterConfig:
    """The outer step a replica of `stage` takes, from its method's (`config`). Stage 0's replicas are
    the data nodes, each on its own shard: under `stage0 = "mean"` they replace it with their group's
    mean every `stage0_every` steps, under `"gradients"` (whose per-step gradient mean is
    shoal/node/pipeline/data/gradients.py) every `stage0_resync_every` (α 0, β 1, γ 1 make NoLoCo's
    step, or DiLoCo's with α 0, β 1, exactly that mean). Trained apart for H steps, two data nodes ended
    0.25-0.6 nats behind one (docs/benchmarks.md, "Data nodes")."""
    if stage == 0 and averaging.stage0 != "outer":
        plain_mean = {"alpha": 0.0, "beta": 1.0, "inner_steps": epoch_steps(averaging, stage)}
        config = dataclasses.replace(config, **plain_mean, **({"gamma": 1.0} if config.mode == "noloco" else {}))
    return config


def epoch_steps(averaging: AveragingConfig, stage: int) -> int:
    """Inner steps to an outer epoch of `stage`'s replicas (see `stage_outer_config`)."""
    if stage == 0 and averaging.stage0 != "outer":
        return averaging.stage0_every if averaging.stage0 == "mean" else averaging.stage0_resync_every
    return averaging.inner_steps


def outer_codec_name(averaging: AveragingConfig, stage: int) -> str:
    """What the outer exchange of `stage` sends. Data nodes that average stage 0's gradients step in
    lockstep, and their weights' mean every `stage0_resync_every` steps must keep them bit-identical:
    it goes in float32, whatever the run's codec."""
    return "float32" if stage == 0 and averaging.stage0 == "gradients" else averaging.codec


@functools.cache
def exchange_timeout_s(run: RunConfig) -> float:
    """How long an exchange of this run may take: its `averaging.exchange_timeout_s`, or, where longer,
    the largest exchange one of its stages makes (both sides' pieces by that stage's codec, at the
    planned link speed: planning/time_limits.py; stage 0's gradients counted as its φ and Δ, an upper
    bound). One number for the whole run: a step close waits on the outer step of any stage, so data
    nodes and workers of every stage must agree on it. Shapes come from the stages built on the meta
    device: no memory, no initialisation."""
    averaging, stages = run.averaging, run.pipeline.stages
    if averaging.mode == "none":
        return averaging.exchange_timeout_s
    largest = 0
    for stage in range(stages):
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in build_stage(run.model, stages, stage, run.train.seed).parameters()]
        codec = OuterCodec(outer_codec_name(averaging, stage), averaging.topk_fraction)
        largest = max(largest, codec.bytes_per_exchange(shapes))
    return wait_limit_s(averaging.exchange_timeout_s, 2 * largest)


class Replica(Protocol):
    """The stage worker an averager works for, as the averager sees it."""

    stage: int
    module: torch.nn.Module
    optimizer: InnerOptimizer
    hooks: Hooks

    async def compute(self, fn: Callable[..., Any], *args: Any, priority: int = ...) -> Any: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> Any: ...


class Averager:
    """One replica's outer optimizer. Subclasses exchange with the other replicas in `outer_step`."""

    def __init__(self, ctx: NodeContext, replica: Replica):
        averaging, defense = ctx.run.averaging, ctx.run.defense
        self.ctx, self.worker = ctx, replica
        self.config = self.outer_config(averaging, replica.stage)
        self.timeout_s = exchange_timeout_s(ctx.run)
        self.state = OuterState.from_module(replica.module)
        self.epoch = 0  # outer epochs finished
        self.stepping = False  # an outer step is under way: a snapshot must not take new φ with old θ
        self.local_steps = 0
        self.exchange_s: list[float] = []  # wall time of each exchange
        self.robust, self.tolerance, self.window = defense.robust_outer, defense.outer_tolerance, defense.outer_window
        self.history = OuterHistory()  # the robust outer step's memory (shoal/train/robust.py)

    @classmethod
    def method_config(cls, averaging: AveragingConfig) -> OuterConfig:
        """This method's outer step, with the run's hyper-parameters."""
        raise NotImplementedError

    @classmethod
    def outer_config(cls, averaging: AveragingConfig, stage: int) -> OuterConfig:
        """The outer step this method takes on `stage`."""
        return stage_outer_config(cls.method_config(averaging), averaging, stage)

    async def start(self) -> None:
        """Start what the exchange needs beside the node's streams."""

    async def stop(self) -> None:
        """Stop what `start` started."""

    def due(self, closed_step: int) -> int | None:
        """The epoch that the close of `closed_step` ends, if it ends one we have not taken."""
        return epoch_ended(closed_step, self.config.inner_steps, self.epoch)

    async def outer_step(self, epoch: int) -> None:
        self.stepping = True
        try:
            await self._outer_step(epoch)
        finally:
            self.stepping = False

    async def _outer_step(self, epoch: int) -> None:
        raise NotImplementedError

    def adopt(self, phi: list[torch.Tensor], epoch: int) -> None:
        """Take a live replica's slow weights (joining by copy, or a repair), on our module's device."""
        device = next(self.worker.module.parameters()).device
        self.load(OuterState.from_tensors([p.to(device) for p in phi]), epoch)

    def load(self, state: OuterState, epoch: int) -> None:
        """Go on from this outer state (a copy, a repair, a resumed save)."""
        self.state, self.epoch = state, epoch

    @property
    def maddrs(self) -> list[str]:
        """Where this replica's averaging peers reach it, if not over the node's own streams."""
        return []

    @property
    def excluded(self) -> list[dict]:
        """Partners the robust outer step refused, as node-record entries."""
        return []

    @property
    def last_distance(self) -> float | None:
        """‖θ − θ_partner‖ just before the last exchange (None: none yet, or not measured)."""
        return None

    def stats(self) -> dict:
        raise NotImplementedError
