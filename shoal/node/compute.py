"""One compute thread per node, running torch work off the event loop, backward first.

Torch releases the GIL in its kernels, so the event loop keeps serving heartbeats and RPCs while
a stage computes. Work is taken by priority: a gradient waiting to flow back releases memory and
unblocks upstream peers sooner than one more forward would (the 1F1B idea), so backward goes first.
Weight gradients, which no other peer waits for (zero-bubble pipelining's W pass), come after
both, in the time a stage would otherwise sit idle while the pipeline drains.

A microbatch's forward or backward that has to wait because the thread is computing another job is
a collision (SkipPipe's rule 3: two microbatches on one node at once): `collisions` counts them and
`collision_s` adds up how long they waited, what a shared timetable is meant to bring to zero.

With a trace path, every job appends a line `start end job cpu_s`: start and end on the system's
monotonic clock (one clock for all processes of a machine, so the traces of a swarm on loopback line
up), and the thread CPU seconds it took (less than end - start when other processes had the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

BACKWARD, FORWARD, WEIGHT_GRAD, BACKGROUND = 0, 1, 2, 3
# The compute thread's name as the kernel knows it (`top -H`, /proc/<pid>/task/<tid>/comm, py-spy):
# a benchmark tells the node's torch work from its event loop by it.
COMPUTE_THREAD_OS_NAME = "shoal-compute"


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 bytes) where the kernel shows it; Linux only."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_NAME = 15
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class ComputeThread:
    """`job_context`: entered around every job, on this thread (autocast is thread-local: the node's
    compute precision, shoal/device.py, is set here and nowhere else)."""

    def __init__(
        self,
        name: str = "compute",
        trace_path: str | None = None,
        job_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self._job_context = job_context
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._running = False  # a job is being computed (read from the event loop: a hint, not a lock)
        self.collisions = 0
        self.collision_s = 0.0
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None  # noqa: SIM115 (closed at shutdown)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        name_os_thread(COMPUTE_THREAD_OS_NAME)
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            loop, future, fn, args, queued, collided = job
            started, cpu_started = time.monotonic(), time.thread_time()
            if collided:
                self.collisions += 1
                self.collision_s += started - queued
            self._running = True
            try:
                with self._job_context():
                    result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine, never lost
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
            finally:
                self._running = False
            if self._trace is not None:
                cpu_s = time.thread_time() - cpu_started
                self._trace.write(f"{started:.6f} {time.monotonic():.6f} {job_name(fn)} {cpu_s:.6f}\n")

    def run(self, priority: int, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        collided = priority in (BACKWARD, FORWARD) and (self._running or not self._queue.empty())
        self._queue.put((priority, next(self._order), (loop, future, fn, args, time.monotonic(), collided)))
        return future

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._queue.put((BACKGROUND + 1, next(self._order), None))
        self._thread.join(timeout_s)
        if self._trace is not None and not self._thread.is_alive():
            self._trace.close()


def job_name(fn: Callable[..., Any]) -> str:
    """A job's name in a trace: its function's, without the class (`_run_forward`, `accumulate`)."""
    return getattr(fn, "__name__", type(fn).__name__)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
