"""Start shoal peers as real processes on loopback (port 0) and end them by pid.

Used by `shoal demo`, the tests and the benchmarks. Readiness is a line on stdout (bootstrap) or
a ready file (node), never a fixed sleep; every wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shoal.demo import warm

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 120.0
# How often a demo looks at its progress files: a tiny run's step takes ~50 ms and a GRPO round ~0.1 s,
# so a fault asked for at step or round K lands there, or one later. The live table redraws less often.
POLL_S = 0.02
RENDER_EVERY_S = 0.5


@dataclass
class Peer:
    name: str
    process: subprocess.Popen | warm.WarmProcess
    log_path: Path
    ready_file: Path | None = None
    maddrs: list[str] = field(default_factory=list)
    peer_id: str = ""
    stage: int | None = None
    role: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def current_stage(self) -> int | None:
        """The stage the node holds now (a node that has not trained yet may move: it rewrites the file)."""
        self.refresh()
        return self.stage

    def refresh(self) -> Peer:
        """Take the node's addresses, id, stage and role from its ready file, if it has written one."""
        if self.ready_file is not None and self.ready_file.exists():
            info = json.loads(self.ready_file.read_text())
            self.maddrs, self.peer_id, self.stage, self.role = (
                info["maddrs"],
                info["peer_id"],
                info["stage"],
                info["role"],
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _end_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the launcher dies, so that a launcher
    killed without cleaning up (a timeout's SIGKILL) leaves no node running."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def shoal_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal.cli", *args]


class ProgressTail:
    """A data node's progress file (one JSON event per line), read as it grows: each `poll` parses only
    what was appended since the last one, so a launcher can look every few milliseconds and act at the
    step it was asked to. A line still being written waits for its newline."""

    def __init__(self, path: Path):
        self.path = path
        self.events: list[dict] = []
        self._offset = 0
        self._unfinished = b""

    def poll(self) -> list[dict]:
        """The events appended since the last poll (also kept, in order, in `events`)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._unfinished = (self._unfinished + chunk).split(b"\n")
        new = [json.loads(line) for line in lines if line.strip()]
        self.events += new
        return new


def progress_events(path: Path) -> list[dict]:
    """Every complete event of a data node's progress file so far."""
    return ProgressTail(path).poll()


def done_event(path: Path) -> dict | None:
    return next((e for e in progress_events(path) if e["event"] == "done"), None)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class LocalSwarm:
    """Owns every process it starts; `close()` ends them all by pid (SIGTERM, then SIGKILL).

    With `warm` (the default where Linux offers it) peers are forked from one parent that has
    imported torch and hivemind already (`shoal.demo.warm`); otherwise each is a fresh interpreter.
    """

    def __init__(self, workdir: Path, log_level: str = "INFO", warm_start: bool | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_level = log_level
        if warm_start is None:  # SHOAL_WARM_START=0 starts every peer as a fresh interpreter
            warm_start = warm.available() and os.environ.get("SHOAL_WARM_START", "1") != "0"
        self.warm_start = warm_start
        self.peers: list[Peer] = []

    def _spawn(self, args: list[str], name: str, prefix: Sequence[str] = ()) -> Peer:
        """Start one `shoal` command; its stderr goes to its log, its stdout to a file beside it.
        `prefix` runs it through another command that execs it (`ip netns exec NS`: same pid), cold."""
        stem = f"{len(self.peers):02d}-{name}"
        log_path, stdout_path = self.workdir / f"{stem}.log", self.workdir / f"{stem}.out"
        argv = ["--log-level", self.log_level, *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log_path.write_text("")
        stdout_path.write_text("")
        if self.warm_start and not prefix:
            process: subprocess.Popen | warm.WarmProcess = warm.WarmProcess(argv, stdout_path, log_path, env)
        else:
            with open(log_path, "w") as log, open(stdout_path, "w") as out:
                process = subprocess.Popen(
                    [*prefix, *shoal_command(*argv)],
                    stdout=out,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    text=True,
                    preexec_fn=_end_with_parent,
                )
        peer = Peer(name, process, log_path)
        self.peers.append(peer)
        return peer

    def start_bootstrap(self, *extra: str, prefix: Sequence[str] = ()) -> Peer:
        peer = self._spawn(["bootstrap", "--host-maddrs", LOOPBACK, *extra], "bootstrap", prefix)
        stdout_path = peer.log_path.with_suffix(".out")
        line = warm.first_line(stdout_path, peer.process, START_TIMEOUT_S)  # the first multiaddress
        if not line.startswith("/"):
            raise RuntimeError(f"bootstrap peer did not start: {line!r}\n{peer.log()[-2000:]}")
        peer.maddrs, peer.role = [line], "bootstrap"
        return peer

    def start_node(
        self, initial_peers: list[str], *extra: str, wait: bool = True, name: str = "node", prefix: Sequence[str] = ()
    ) -> Peer:
        index = len(self.peers)
        ready = self.workdir / f"ready-{index:02d}.json"
        if "--threads" not in extra:  # every process of a local swarm shares this machine's cores
            extra = ("--threads", "1", *extra)
        dial = ["--initial-peers", *initial_peers] if initial_peers else []  # none: --swarm NAME in `extra`
        peer = self._spawn(["node", *dial, "--host-maddrs", LOOPBACK, "--ready-file", str(ready), *extra], name, prefix)
        peer.ready_file = ready
        if wait:
            self.wait_ready(peer)
        return peer

    def wait_ready(self, peer: Peer, timeout_s: float = START_TIMEOUT_S) -> Peer:
        assert peer.ready_file is not None

        def ready() -> bool:
            if not peer.alive:
                raise RuntimeError(f"{peer.name} exited with {peer.process.returncode}:\n{peer.log()[-3000:]}")
            return peer.ready_file.exists()

        wait_until(ready, timeout_s, f"{peer.name} to become active")
        return peer.refresh()

    def status(self, initial_peer: str, *extra: str, timeout_s: float = 60.0, prefix: Sequence[str] = ()) -> dict:
        result = subprocess.run(
            [*prefix, *shoal_command("status", "--initial-peers", initial_peer, "--json", *extra)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if result.returncode != 0:
            raise RuntimeError(f"shoal status failed: {result.stderr}")
        return json.loads(result.stdout)

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> None:
        if peer.alive:
            os.kill(peer.pid, sig)

    def stop(self, peer: Peer, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status (SIGKILL after `timeout_s`)."""
        self.kill(peer, signal.SIGTERM)
        try:
            return peer.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(peer)
            return peer.process.wait(timeout=10)

    def close(self, timeout_s: float = 15.0) -> None:
        """End every process: SIGTERM all at once, wait, then SIGKILL what is left."""
        for peer in self.peers:
            self.kill(peer, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for peer in self.peers:
            try:
                peer.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(peer)
                peer.process.wait(timeout=10)
