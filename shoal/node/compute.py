"""One compute thread per node, running torch work off the event loop, backward first.

Torch releases the GIL in its kernels, so the event loop keeps serving heartbeats and RPCs while
a stage computes. Work is taken by priority: a gradient waiting to flow back releases memory and
unblocks upstream peers sooner than one more forward would (the 1F1B idea), so backward goes first.
Weight gradients, which no other peer waits for (zero-bubble pipelining's W pass), come after
both, in the time a stage would otherwise sit idle while the pipeline drains.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

BACKWARD, FORWARD, WEIGHT_GRAD, BACKGROUND = 0, 1, 2, 3


class ComputeThread:
    def __init__(self, name: str = "compute"):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            loop, future, fn, args = job
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine, never lost
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    def run(self, priority: int, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._order), (loop, future, fn, args)))
        return future

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._queue.put((BACKGROUND + 1, next(self._order), None))
        self._thread.join(timeout_s)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
