"""Running a daemon from the CLI: uvloop (installed here, in one place), signals, a bounded exit.

A stop signal starts a clean shutdown (announce leaving, drain, save). That shutdown can wait on a
thread that never returns: a library call stuck in a lock, a stalled disk. Python would then wait
for it forever, once in the event loop's executor and once more at interpreter exit. So the first
signal also starts a watchdog: if the process is still alive `exit_timeout_s` later, it logs what
each remaining thread is doing and exits with status 1. A second SIGINT (Ctrl-C pressed again) exits
at once; a SIGTERM after a SIGINT does not, since a launcher that stops its children after Ctrl-C
reached their whole process group sends exactly that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import Protocol

from shoal.node.config import EXIT_TIMEOUT_S

logger = logging.getLogger(__name__)

FORCED_EXIT_STATUS = 1


class Daemon(Protocol):
    def request_stop(self) -> None: ...
    async def run_until_stopped(self) -> None: ...
    async def shutdown(self) -> None: ...


def run_daemon(
    create: Callable[[], Awaitable[Daemon]],
    on_ready: Callable[[Daemon], Awaitable[None]] | None = None,
    exit_timeout_s: float = EXIT_TIMEOUT_S,
) -> int:
    """Create the daemon, serve until SIGTERM/SIGINT, then shut it down; returns the exit status.
    The process ends at most `exit_timeout_s` after the first stop signal, and at once on a second SIGINT."""
    import uvloop

    exit_guard = ExitGuard(exit_timeout_s)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop_early = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, exit_guard.on_signal, sig, stop_early.set)
        daemon = await create()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, exit_guard.on_signal, sig, daemon.request_stop)
        if stop_early.is_set():
            daemon.request_stop()
        try:
            if on_ready is not None:
                await on_ready(daemon)
            await daemon.run_until_stopped()
        finally:
            exit_guard.arm()  # a stop from within (a data node done training) is bounded the same way
            await daemon.shutdown()
        return 0

    logging.getLogger("hivemind").setLevel(max(logging.getLogger().level, logging.WARNING))
    return uvloop.run(main())


class ExitGuard:
    """Bounds how long the process may take to end once it has been asked to."""

    def __init__(self, exit_timeout_s: float):
        self.exit_timeout_s = exit_timeout_s
        self._watchdog: threading.Timer | None = None
        self._interrupted = False

    def on_signal(self, sig: signal.Signals, request_stop: Callable[[], None]) -> None:
        if sig == signal.SIGINT:
            if self._interrupted:
                _exit_now("interrupted again: exiting without finishing the shutdown")
            self._interrupted = True
        self.arm()
        request_stop()

    def arm(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.exit_timeout_s, self._expire)
            self._watchdog.name = "exit-watchdog"
            self._watchdog.daemon = True  # it must not keep alive a process that ends in time
            self._watchdog.start()

    def _expire(self) -> None:
        _exit_now(f"still running {self.exit_timeout_s:.0f} s after the stop; exiting without finishing. "
                  f"Threads: {describe_threads()}")  # fmt: skip


def describe_threads() -> str:
    """Every other live thread and the line it is at: where a stuck shutdown waits."""
    frames = sys._current_frames()
    described = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident not in frames:
            continue
        top = traceback.extract_stack(frames[thread.ident])[-1]
        described.append(f"{thread.name} at {os.path.basename(top.filename)}:{top.lineno} in {top.name}")
    return "; ".join(described) or "none"


def _exit_now(why: str) -> None:
    logger.error(why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FORCED_EXIT_STATUS)
