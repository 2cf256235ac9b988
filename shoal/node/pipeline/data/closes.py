"""The step close: a data node tells every live worker that its step is over, so that they take their
inner step (and, every H steps, their outer step), and waits for their answers only where it must.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from shoal.node.averaging.base import exchange_timeout_s
from shoal.node.context import NodeContext
from shoal.node.pipeline.hops import step_close_patience_s
from shoal.node.rpcs import EngineRpcs
from shoal.protocol.pipeline import StepClose

logger = logging.getLogger(__name__)


class StepCloses:
    """`rpc`: the engine's calls, on its kept streams (a close goes out on one of them); `spawn`: keeps the task
    that waits for the answers, so shutdown can cancel it."""

    def __init__(self, ctx: NodeContext, rpc: EngineRpcs, spawn: Callable[[Awaitable[Any], str], asyncio.Future]):
        self.ctx, self.rpc, self.spawn = ctx, rpc, spawn
        self.closing: asyncio.Future | None = None  # the workers' answers to our last step close

    def workers_average_after(self, step: int) -> bool:
        averaging = self.ctx.run.averaging
        return averaging.mode != "none" and (step + 1) % averaging.inner_steps == 0

    async def taken(self) -> None:
        """Every worker has answered our last step close (or failed to)."""
        if self.closing is not None:
            await asyncio.shield(self.closing)

    def close(self, step: int, completed: int, abandoned: int, served: Collection[str]) -> asyncio.Future:
        """Tell the workers that this step is over (`served`: those that served it); returns the task
        that waits for their answers.

        The next step need not wait for them: a worker holds a forward of step s until it has handled
        our close of step s-1 (stepped and, every H steps, averaged), so it never runs on stale
        weights, while our embedding and first hop of the next step overlap its inner step. The close
        goes out on a stream of its own and may arrive after the forwards it precedes; that stream is
        kept for the next step's close, since opening one (a round trip and a protocol negotiation)
        would lie on every step's critical path: the worker's step, and so the next forward, waits for it."""
        close = StepClose(step=step, completed=completed, abandoned=abandoned)
        view = self.ctx.view
        live = {n.peer_id for n in view.live_nodes()} if view is not None else set()
        workers = {n.peer_id for n in view.live_nodes() if n.stage > 0} if view is not None else set()
        # every live worker hears it: replicas that served nothing this step still keep the outer-epoch clock
        peers = sorted(p for p in set(served) | workers if p in live or not live)

        async def tell(peer: str) -> None:
            await self.ctx.hooks.before_close_sent()  # fault injection: the next step's forwards overtake it
            try:
                timeout_s = step_close_patience_s(exchange_timeout_s(self.ctx.run))
                await self.rpc.step_close(peer, close, timeout_s)
            except Exception as e:
                logger.info("[%s] step %d close not taken by %s: %s", self.ctx.short_id, step, peer[-8:], e)

        self.closing = self.spawn(asyncio.gather(*(tell(peer) for peer in peers)), f"close step {step}")
        return self.closing
