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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.config import RunConfig
from shoal.node.engine import Engine, TrainedState
from shoal.node.state.store import SavedState, StateDir
from shoal.planning.swarm_view import ROLE_ROLLOUT, STATE_ACTIVE, SwarmView

logger = logging.getLogger(__name__)

POSTPONED_RETRY_S = 0.5  # a save that met an outer step in progress is tried again this soon
FINAL_SAVE_WAIT_S = 10.0  # at shutdown, how long to wait for an outer step in progress to end


@dataclass(frozen=True)
class Holder:
    """Whose state a save is: the run, the peer, and what it holds now."""

    run: RunConfig
    peer_id: str
    stage: int
    role: str

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]


Current = Callable[[], tuple[Engine | None, Holder]]  # the node's engine and holder, as they are now


def saved_state(state: TrainedState, holder: Holder) -> SavedState:
    return SavedState(
        run_id=holder.run.run_id,
        peer_id=holder.peer_id,
        stage=holder.stage,
        role=holder.role,
        inner_step=state.inner_step,
        outer_epoch=state.outer_epoch,
        lr_scale=state.lr_scale,
        weights=state.weights,
        inner=state.inner,
        phi=state.phi,
        momentum=state.momentum,
        saved_at=time.time(),
    )


def trained_state(saved: SavedState) -> TrainedState:
    return TrainedState(
        inner_step=saved.inner_step,
        outer_epoch=saved.outer_epoch,
        lr_scale=saved.lr_scale,
        weights=saved.weights,
        inner=saved.inner,
        phi=saved.phi,
        momentum=saved.momentum,
    )


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

    async def resume(self, engine: Engine, holder: Holder, view: SwarmView | None) -> bool:
        """Take the saved state for the stage `engine` holds (or a live replica's, if ahead); returns
        whether the engine now holds trained weights from either."""
        saved, self.saved = self.saved, None
        if saved is None:
            return False
        if saved.stage != holder.stage:
            logger.info("[%s] takes stage %s, its saved state is for stage %d: not restoring it", holder.short_id,
                        holder.stage, saved.stage)  # fmt: skip
            return False
        if await self._copy_if_behind(engine, holder, view, saved):
            return True
        await engine.load_state_dict(trained_state(saved))
        logger.info("[%s] resumed stage %d from %s (inner step %d, outer epoch %d)", holder.short_id, saved.stage,
                    self.store.path, saved.inner_step, saved.outer_epoch)  # fmt: skip
        return True

    async def _copy_if_behind(self, engine: Engine, holder: Holder, view: SwarmView | None, saved: SavedState) -> bool:
        """A block stage whose live replicas trained past our save: copy the most trained one."""
        if not saved.stage or view is None:
            return False
        ahead = [n for n in view.replicas(saved.stage, exclude=holder.peer_id)
                 if n.state == STATE_ACTIVE and n.inner_step > saved.inner_step]  # fmt: skip
        if not ahead:
            return False
        best = max(n.inner_step for n in ahead)
        logger.info("[%s] live replicas of stage %d are ahead of the saved state (inner step %d > %d): copying",
                    holder.short_id, saved.stage, best, saved.inner_step)  # fmt: skip
        if await engine.join_by_copy() is not None:
            return True
        logger.warning("[%s] no live replica gave its weights: resuming from the saved state", holder.short_id)
        return False

    async def save(self, engine: Engine | None, holder: Holder, wait_s: float = 0.0) -> bool:
        """Save now if there is something new; False if postponed (an outer step is running)."""
        if engine is None or holder.role == ROLE_ROLLOUT:
            return True
        progress = engine.progress()
        if (holder.stage, progress.inner_step, progress.outer_epoch) == self._last:
            return True  # nothing new since the last save (a cheap look before cloning anything)
        deadline = time.monotonic() + wait_s
        async with self._saving:
            while (state := await engine.state_dict()) is None:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.05)
            key = (holder.stage, state.inner_step, state.outer_epoch)
            if key == self._last:
                return True
            loop = asyncio.get_running_loop()
            path = await loop.run_in_executor(None, self.store.save, saved_state(state, holder), holder.run)
            self._last = key
            self.saves += 1
            logger.info("[%s] saved stage %d at inner step %d to %s", holder.short_id, holder.stage,
                        state.inner_step, path)  # fmt: skip
        return True

    async def run(self, current: Current) -> None:
        """Save every `every_s` seconds while the node runs."""
        delay = self.every_s
        while True:
            await asyncio.sleep(delay)
            engine, holder = current()
            try:
                delay = self.every_s if await self.save(engine, holder) else POSTPONED_RETRY_S
            except Exception as e:  # a full disk must not stop the node: say so, and try again next time
                logger.error("[%s] could not save its state to %s: %s", holder.short_id, self.store.path, e)
                delay = self.every_s

    async def close(self, current: Current) -> None:
        """The last save, at a clean shutdown; then let go of the folder."""
        engine, holder = current()
        try:
            if not await self.save(engine, holder, wait_s=FINAL_SAVE_WAIT_S):
                logger.warning("[%s] an outer step was still running: kept the previous save", holder.short_id)
        except Exception as e:
            logger.error("[%s] could not save its state to %s: %s", holder.short_id, self.store.path, e)
        finally:
            self.store.release()
