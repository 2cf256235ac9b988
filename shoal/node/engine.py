"""What a node runs: one engine at a time (a stage worker, a data node, a rollout worker), behind one
interface.

The node (daemon.py) starts and stops its engine, serves the engine's RPC handlers, publishes the
engine's `progress()` in its record and saves its `state_dict()`; it never looks inside an engine,
and an engine never touches the node: it gets a `NodeContext` (context.py) and reports back only
through what it returns. Outcomes are typed (`AbandonReason`, `OuterStep`), so what the metrics,
the status table and the tests read is a field, not a phrase searched in a log line.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from shoal.config import RunConfig
from shoal.p2p.rpc import Rpc
from shoal.planning.observed import Trip
from shoal.planning.swarm_view import BackupNote, SwarmView
from shoal.train.inner import InnerOptimizer
from shoal.train.outer import OuterState

Handler = Callable[..., Awaitable[Any]]  # an RPC's handler: (request, [stream,] sender) -> reply


class AbandonReason(enum.StrEnum):
    """Why a microbatch was given up: the kinds a data node's ledger and metrics count by."""

    STAGE_LOST = "stage_lost"  # a stage had no live replica for the whole stage wait
    ATTEMPTS = "attempts"  # every attempt's forward was lost before it came home
    TIMEOUT = "timeout"  # it did not end within the microbatch timeout
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    RECOVER = "recover"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str) -> AbandonReason:
        """A kind a peer sent (`AbandonNotice.kind`); one this node does not know is `other`."""
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER


@dataclass(frozen=True)
class OuterStep:
    """One outer step of a stage replica, as its averager logs it."""

    epoch: int
    partner: str | None  # whose tensors came in (None: nobody's)
    took_partner: bool  # whether they were used (the robust outer step may refuse them)
    own_delta_norm: float  # ‖Δ_own‖
    phi_moved: float  # ‖φ_{t+1} − φ_t‖
    partner_gap: float | None  # ‖θ_partner − θ‖ of what was taken (None: nothing)

    def as_list(self) -> list:
        """The JSON form the stats file carries: `[epoch, partner, took, ‖Δ‖, moved, gap]`."""
        values = [self.epoch, self.partner, self.took_partner, self.own_delta_norm, self.phi_moved, self.partner_gap]
        return [round(v, 6) if isinstance(v, float) else v for v in values]


@dataclass(frozen=True)
class Repair:
    """How a node rebuilt a stage no replica held any more (CheckFree), as its record announces it."""

    stage: int
    rule: str
    sources: list[int]
    inner_step: int
    seconds: float
    at: float  # DHT time
    note: str = ""

    def as_record(self) -> dict:
        return {"stage": self.stage, "rule": self.rule, "sources": list(self.sources), "inner_step": self.inner_step,
                "seconds": self.seconds, "at": self.at, "note": self.note}  # fmt: skip


@dataclass(frozen=True)
class Progress:
    """What a node publishes of its engine in its record, and shows in its metrics and stats."""

    inner_step: int = 0
    outer_epoch: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    grad_norm_clipped: float | None = None
    replica_distance: float | None = None  # to the last NoLoCo partner, before averaging
    repair: Repair | None = None
    waiting_for: tuple[int, ...] = ()  # stages a data node waits for a live replica of
    averager_maddrs: tuple[str, ...] = ()  # DiLoCo: where this replica's averaging DHT listens
    model_id: str | None = None  # a rollout worker's policy
    excluded: tuple[dict, ...] = ()  # [{peer_id, reason}]: peers this engine refused, bounded by it
    backup: BackupNote | None = None  # a block-stage replica's latest backup snapshot (stage/backups.py)


@dataclass(frozen=True)
class TrainedState:
    """An engine's trained state: what `--state-dir` saves and a restarted node resumes from."""

    inner_step: int  # inner optimizer steps taken (a data node's next step: its position in its data)
    outer_epoch: int
    lr_scale: float
    weights: tuple[torch.Tensor, ...]
    inner: dict  # AdamW's per-parameter state
    phi: tuple[torch.Tensor, ...] | None = None  # the outer optimizer's slow weights, where it has them
    momentum: tuple[torch.Tensor, ...] | None = None


@dataclass
class GradNorms:
    """The last inner step's gradient norm, raw and as clipped (a copy's and a repair's inputs)."""

    raw: float | None = None
    clipped: float | None = None

    def note(self, grad_norm: float, clip: float) -> None:
        self.raw, self.clipped = grad_norm, min(grad_norm, clip)


@runtime_checkable
class Engine(Protocol):
    """The duty a node runs; `stop` at shutdown or a stage move."""

    async def start(self) -> None:
        """Get ready to serve: load its data (a data node), start averaging (a stage worker, once it
        holds its weights), warm its policy up (a rollout worker)."""
        ...

    async def work(self) -> dict | None:
        """Its own work until done: a data node's training steps, a rollout worker's rounds (a stage
        worker drives nothing and returns at once); returns the summary."""
        ...

    async def stop(self) -> None: ...

    def handlers(self) -> Mapping[Rpc, Handler]:
        """The RPCs it answers (`EngineRpcs.forward`, ... in rpcs.py): the rest are refused."""
        ...

    def progress(self) -> Progress: ...

    def stats(self) -> dict: ...

    @property
    def busy(self) -> bool:
        """It holds in-flight work: shutdown drains until it does not."""
        ...

    @property
    def movable(self) -> bool:
        """Untrained and idle: the node may still change stage without losing anything."""
        ...

    def traffic_counts(self) -> dict[str, int]: ...

    def trips(self) -> Sequence[Trip]:
        """Forward trips of its own microbatches (a data node's), which routing fits hop times to."""
        ...

    def on_view(self, view: SwarmView) -> None: ...

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """Peers came back under the same peer id: what went through their old processes is lost."""
        ...

    async def state_dict(self) -> TrainedState | None:
        """Its trained state now (None: nothing to save, or an outer step is under way)."""
        ...

    async def load_state_dict(self, state: TrainedState) -> None: ...

    async def join_by_copy(self) -> str | None:
        """Take a live replica's weights before serving; returns whom it copied (None: nobody)."""
        ...


def snapshot_trained(
    module: torch.nn.Module, optimizer: InnerOptimizer, outer: OuterState | None, outer_epoch: int
) -> TrainedState:
    """A copy, in host memory, of a module's weights with its inner (and outer) optimizer state, taken
    between compute jobs."""
    adamw = optimizer.adamw.state_dict()["state"]
    return TrainedState(
        inner_step=optimizer.step_count,
        outer_epoch=outer_epoch,
        lr_scale=float(optimizer.lr_scale),
        weights=tuple(_host_copy(p, torch.float32) for p in module.parameters()),
        inner={"state": {i: {k: _host_copy(v) for k, v in entry.items()} for i, entry in adamw.items()}},
        phi=None if outer is None else tuple(_host_copy(p) for p in outer.phi),
        momentum=None if outer is None else tuple(_host_copy(m) for m in outer.momentum),
    )


def _host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype or t.dtype, copy=True)


def restore_trained(module: torch.nn.Module, state: TrainedState, run: RunConfig) -> InnerOptimizer:
    """Load `state`'s weights into `module`; returns the inner optimizer at its saved state, with the
    run's hyper-parameters (not the saved ones)."""
    with torch.no_grad():
        for param, value in zip(module.parameters(), state.weights, strict=True):
            param.copy_(value)
    optimizer = InnerOptimizer(module, run.optim, run.train.steps, lr_scale=state.lr_scale)
    groups = optimizer.adamw.state_dict()["param_groups"]
    optimizer.adamw.load_state_dict({"state": copy.copy(state.inner["state"]), "param_groups": groups})
    optimizer.step_count = state.inner_step
    return optimizer


def outer_state_of(state: TrainedState, module: torch.nn.Module) -> OuterState:
    """The slow weights a restored replica averages from, on the module's device: the saved ones, or
    (saved by a run that did not average) the weights themselves, as for a fresh replica."""
    if state.phi is not None and state.momentum is not None:
        device = next(module.parameters()).device
        return OuterState(phi=tuple(p.to(device) for p in state.phi),
                          momentum=tuple(m.to(device) for m in state.momentum))  # fmt: skip
    return OuterState.from_module(module)
