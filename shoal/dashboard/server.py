"""The dashboard: polls a run's view from the DHT and serves a page and the JSON it draws.

It joins the DHT as a client, as `shoal status` does, reads the run's node records every
`interval_s` seconds into a `History`, and answers plain HTTP/1.1 from the same event loop:
`GET /` the page (static/index.html, no script from anywhere else), `GET /api/state` the JSON the
page polls. It listens on loopback unless told otherwise and has no authentication.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from shoal.config import RunConfig
from shoal.dashboard.history import History
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.http import answer_one_request
from shoal.node.cli.status import swarm_needs

logger = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "static" / "index.html"
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 30.0  # one DHT read of the run's node records


class Dashboard:
    """A DHT client, the history of what it saw, and an HTTP server; `create()` / `shutdown()`."""

    def __init__(self, dht: SwarmDHT, run: RunConfig, interval_s: float):
        self.dht, self.run, self.interval_s = dht, run, interval_s
        self.history = History(tokens_per_step=run.train.batch_size * run.train.seq_len)
        self.page = PAGE.read_bytes()
        self.reads = 0
        self.errors = 0
        self.last_error: str | None = None
        self.server: asyncio.Server | None = None
        self._poller: asyncio.Task | None = None
        self._stop = asyncio.Event()

    @classmethod
    async def create(cls, dht: SwarmDHT, run: RunConfig, host: str, port: int, interval_s: float = 3.0) -> Dashboard:
        """Serve on `host:port` (port 0: a free one) once the first view is read; owns `dht` from here on."""
        self = cls(dht, run, interval_s)
        try:
            await self.poll_once()
            try:
                self.server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES)
            except OSError as e:
                raise UsageError(f"--port: cannot listen on {host}:{port} ({e.strerror or e})") from None
        except BaseException:
            await self.dht.shutdown()
            raise
        self._poller = asyncio.create_task(self._poll())
        return self

    @property
    def url(self) -> str:
        assert self.server is not None, "create() first"
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    async def poll_once(self) -> None:
        """Read the run's view and add it to the history; a failed read is counted and shown."""
        try:
            view = await asyncio.wait_for(self.dht.read_view(self.run), READ_TIMEOUT_S)
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            logger.warning("reading the swarm's view failed: %s", self.last_error)
            return
        self.reads += 1
        self.last_error = None
        for event in self.history.observe(view):
            logger.info("%s", event.text)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    def state(self) -> dict[str, Any]:
        """`/api/state`: the run, what it needs, the reader's health, and the history."""
        view = self.history.view
        run = self.run
        return {
            "run": {"name": run.name, "run_id": run.run_id, "stages": run.pipeline.stages, "steps": run.train.steps},
            "interval_s": self.interval_s,
            "reads": self.reads,
            "errors": self.errors,
            "last_error": self.last_error,
            "needs": None if view is None else swarm_needs(view),
            **self.history.state(),
        }

    def _respond(self, method: str, path: str) -> tuple[str, bytes, str]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        route = path.split("?", 1)[0]
        if route in ("/", "/index.html"):
            return "200 OK", self.page, "text/html; charset=utf-8"
        if route == "/api/state":
            return "200 OK", json.dumps(self.state()).encode(), "application/json"
        return "404 Not Found", b"see / and /api/state\n", "text/plain"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_one_request(reader, writer, self._respond, "Cache-Control: no-store\r\n")

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        await self.dht.shutdown()
