"""Running a daemon from the CLI: uvloop (installed here, in one place), signals, clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol


class Daemon(Protocol):
    def request_stop(self) -> None: ...
    async def run_until_stopped(self) -> None: ...
    async def shutdown(self) -> None: ...


def run_daemon(
    create: Callable[[], Awaitable[Daemon]], on_ready: Callable[[Daemon], Awaitable[None]] | None = None
) -> int:
    """Create the daemon, serve until SIGTERM/SIGINT, then shut it down; returns the exit status."""
    import uvloop

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop_early = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_early.set)
        daemon = await create()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop)
        if stop_early.is_set():
            daemon.request_stop()
        try:
            if on_ready is not None:
                await on_ready(daemon)
            await daemon.run_until_stopped()
        finally:
            await daemon.shutdown()
        return 0

    logging.getLogger("hivemind").setLevel(max(logging.getLogger().level, logging.WARNING))
    return uvloop.run(main())
