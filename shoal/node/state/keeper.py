"""Persistent node state in the daemon: save to --state-dir every `--save-every-s` and at shutdown,
and resume from it after a restart (the format and its checks are in state_dir.py).

What a node keeps: its identity (so its peer id survives), its stage's weights, AdamW's state, the
outer optimizer's slow weights and momentum (NoLoCo, DiLoCo), and its counters. A restarted node
resumes when the saved run is the current one: it asks the planner for a stage with its saved stage
as its current one, so it takes that stage back unless the swarm needs it elsewhere more; on that
stage it takes its saved weights, unless a live replica has trained further (a higher inner step),
in which case it copies that replica as any joiner does. A data node resumes at its saved step (the
batch of a step is a pure function of run, shard and step, so the step is its data position); the
steps between its last save and its end are trained again. Rollout workers keep only their identity.

A snapshot is taken on the engine's compute thread, between two compute jobs, so weights, optimizer
state and step counter belong to the same step; never during an outer step, whose new slow weights
would not match the weights yet.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from shoal.node.stage.copy import copy_stage
from shoal.node.state.store import SavedState, StateDir
from shoal.planning.swarm_view import ROLE_ROLLOUT, STATE_ACTIVE
from shoal.train.inner import InnerOptimizer
from shoal.train.outer import OuterState

if TYPE_CHECKING:
    from shoal.config import RunConfig
    from shoal.node.daemon import Node

logger = logging.getLogger(__name__)

POSTPONED_RETRY_S = 0.5  # a save that met an outer step in progress is tried again this soon
FINAL_SAVE_WAIT_S = 10.0  # at shutdown, how long to wait for an outer step in progress to end


def _module(engine: Any) -> torch.nn.Module:
    """The stage's module: a stage worker's blocks, or a data node's embedding, norm and head."""
    module = getattr(engine, "module", None)
    return module if module is not None else engine.head


def _averager(engine: Any) -> Any:
    return getattr(engine, "averager", None)


def _clone_inner(optimizer: InnerOptimizer) -> dict:
    state = optimizer.adamw.state_dict()["state"]
    return {"state": {i: {k: v.detach().clone() for k, v in entry.items()} for i, entry in state.items()}}


def snapshot(engine: Any, node: Node) -> SavedState | None:
    """The engine's state now, or None during an outer step (run it on the compute thread, so that
    no inner step runs meanwhile)."""
    averager = _averager(engine)
    if getattr(averager, "stepping", False):
        return None
    outer: OuterState | None = averager.state if averager is not None else None
    return SavedState(
        run_id=node.run.run_id,
        peer_id=node.peer_id,
        stage=int(node.stage or 0),
        role=node.role,
        inner_step=engine.optimizer.step_count,
        outer_epoch=averager.epoch if averager is not None else 0,
        lr_scale=float(engine.optimizer.lr_scale),
        weights=tuple(p.detach().to(torch.float32, copy=True) for p in _module(engine).parameters()),
        inner=_clone_inner(engine.optimizer),
        phi=None if outer is None else tuple(p.clone() for p in outer.phi),
        momentum=None if outer is None else tuple(m.clone() for m in outer.momentum),
        saved_at=time.time(),
    )


def restore(engine: Any, saved: SavedState, run: RunConfig) -> None:
    """Load `saved` into the engine (on the compute thread). Checked by StateDir.load already."""
    module = _module(engine)
    with torch.no_grad():
        for param, value in zip(module.parameters(), saved.weights, strict=True):
            param.copy_(value)
    optimizer = InnerOptimizer(module, run.optim, run.train.steps, lr_scale=saved.lr_scale)
    groups = optimizer.adamw.state_dict()["param_groups"]  # the run's hyper-parameters, not the file's
    optimizer.adamw.load_state_dict({"state": copy.copy(saved.inner["state"]), "param_groups": groups})
    optimizer.step_count = saved.inner_step
    engine.optimizer = optimizer
    averager = _averager(engine)
    if averager is not None:
        if saved.phi is not None and saved.momentum is not None:
            averager.state = OuterState(phi=saved.phi, momentum=saved.momentum)
        else:  # saved by a run that did not average: φ starts at the weights, as for a fresh replica
            averager.state = OuterState.from_module(module)
        averager.epoch = saved.outer_epoch
    if hasattr(engine, "first_step"):
        engine.first_step = saved.inner_step  # a data node goes on from its saved step


class StateKeeper:
    """This node's --state-dir: loads what was saved at start, resumes from it, saves as it trains."""

    def __init__(self, store: StateDir, every_s: float):
        self.store, self.every_s = store, every_s
        self.saved: SavedState | None = None  # loaded at start, until the node resumes from it
        self.saves = 0
        self._last: tuple[int, int, int] | None = None  # (stage, inner step, outer epoch) last written
        self._saving = asyncio.Lock()

    @classmethod
    def open(cls, path: str, every_s: float) -> StateKeeper:
        store = StateDir(path)
        store.acquire()
        return cls(store, every_s)

    @property
    def saved_stage(self) -> int | None:
        return None if self.saved is None else self.saved.stage

    def load(self, run: RunConfig, peer_id: str) -> None:
        """Read and check the saved state (raises StateRefused, which changes nothing)."""
        if run.mode == "grpo":
            logger.info("[%s] rollout workers keep only their identity in %s", peer_id[-8:], self.store.path)
            return
        self.saved = self.store.load(run, peer_id)
        if self.saved is None:
            logger.info("[%s] no saved state in %s yet: starting fresh", peer_id[-8:], self.store.path)
            return
        s = self.saved
        self._last = (s.stage, s.inner_step, s.outer_epoch)
        logger.info("[%s] saved state in %s: stage %d, inner step %d, outer epoch %d, %.0f s old", peer_id[-8:],
                    self.store.path, s.stage, s.inner_step, s.outer_epoch, time.time() - s.saved_at)  # fmt: skip

    async def resume(self, node: Node, engine: Any) -> bool:
        """Take the saved state for the stage `engine` holds (or a live replica's, if ahead); returns
        whether the engine now holds trained weights from either."""
        saved, self.saved = self.saved, None
        if saved is None:
            return False
        if saved.stage != node.stage:
            logger.info("[%s] takes stage %s, its saved state is for stage %d: not restoring it", node.short_id,
                        node.stage, saved.stage)  # fmt: skip
            return False
        if await self._copy_if_behind(node, engine, saved):
            return True
        await engine.compute(restore, engine, saved, node.run)
        node.inner_step, node.outer_epoch = saved.inner_step, saved.outer_epoch
        logger.info("[%s] resumed stage %d from %s (inner step %d, outer epoch %d)", node.short_id, saved.stage,
                    self.store.path, saved.inner_step, saved.outer_epoch)  # fmt: skip
        return True

    async def _copy_if_behind(self, node: Node, engine: Any, saved: SavedState) -> bool:
        """A block stage whose live replicas trained past our save: copy the most trained one."""
        view = node.view
        if not saved.stage or view is None:
            return False
        ahead = [n for n in view.replicas(saved.stage, exclude=node.peer_id)
                 if n.state == STATE_ACTIVE and n.inner_step > saved.inner_step]  # fmt: skip
        if not ahead:
            return False
        best = max(n.inner_step for n in ahead)
        logger.info("[%s] live replicas of stage %d are ahead of the saved state (inner step %d > %d): copying",
                    node.short_id, saved.stage, best, saved.inner_step)  # fmt: skip
        if await copy_stage(engine) is not None:
            return True
        logger.warning("[%s] no live replica gave its weights: resuming from the saved state", node.short_id)
        return False

    async def save(self, node: Node, wait_s: float = 0.0) -> bool:
        """Save now if there is something new; False if postponed (an outer step is running)."""
        engine = node.engine
        if engine is None or node.role == ROLE_ROLLOUT or not hasattr(engine, "optimizer"):
            return True
        averager = _averager(engine)
        if (node.stage or 0, engine.optimizer.step_count, averager.epoch if averager else 0) == self._last:
            return True  # nothing new since the last save (a cheap look before cloning anything)
        deadline = time.monotonic() + wait_s
        async with self._saving:
            while (state := await engine.compute(snapshot, engine, node)) is None:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.05)
            key = (state.stage, state.inner_step, state.outer_epoch)
            if key == self._last:
                return True
            loop = asyncio.get_running_loop()
            path = await loop.run_in_executor(None, self.store.save, state, node.run)
            self._last = key
            self.saves += 1
            logger.info("[%s] saved stage %d at inner step %d to %s", node.short_id, state.stage, state.inner_step,
                        path)  # fmt: skip
        return True

    async def run(self, node: Node) -> None:
        """Save every `every_s` seconds while the node runs."""
        delay = self.every_s
        while True:
            await asyncio.sleep(delay)
            try:
                delay = self.every_s if await self.save(node) else POSTPONED_RETRY_S
            except Exception as e:  # a full disk must not stop the node: say so, and try again next time
                logger.error("[%s] could not save its state to %s: %s", node.short_id, self.store.path, e)
                delay = self.every_s

    async def close(self, node: Node) -> None:
        """The last save, at a clean shutdown; then let go of the folder."""
        try:
            if not await self.save(node, wait_s=FINAL_SAVE_WAIT_S):
                logger.warning("[%s] an outer step was still running: kept the previous save", node.short_id)
        except Exception as e:
            logger.error("[%s] could not save its state to %s: %s", node.short_id, self.store.path, e)
        finally:
            self.store.release()
