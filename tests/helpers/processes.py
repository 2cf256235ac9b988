"""Start shoal peers as real processes on loopback (port 0) and end them by pid.

Readiness is a line on stdout (bootstrap) or a ready file (node), never a fixed sleep; every wait
is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 90.0


@dataclass
class Peer:
    process: subprocess.Popen
    log_path: Path
    maddrs: list[str] = field(default_factory=list)
    peer_id: str = ""
    stage: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def shoal_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal.cli", *args]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Swarm:
    """Owns every process a test starts; `close()` ends them all by pid."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.peers: list[Peer] = []
        self._count = 0

    def _spawn(self, args: list[str], name: str, stdout=subprocess.PIPE) -> Peer:
        self._count += 1
        log_path = self.workdir / f"{self._count:02d}-{name}.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed when the process ends
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process = subprocess.Popen(shoal_command("--log-level", "INFO", *args), stdout=stdout, stderr=log,
                                   env=env, text=True)
        peer = Peer(process, log_path)
        self.peers.append(peer)
        return peer

    def start_bootstrap(self, *extra: str) -> Peer:
        peer = self._spawn(["bootstrap", "--host-maddrs", LOOPBACK, *extra], "bootstrap")
        assert peer.process.stdout is not None
        line = peer.process.stdout.readline().strip()  # the first multiaddress, once it listens
        if not line.startswith("/"):
            raise RuntimeError(f"bootstrap did not print an address: {line!r}\n{peer.log()}")
        peer.maddrs = [line]
        return peer

    def start_node(self, initial_peers: list[str], *extra: str, wait: bool = True) -> Peer:
        ready = self.workdir / f"ready-{self._count + 1:02d}.json"
        peer = self._spawn(["node", "--initial-peers", *initial_peers, "--host-maddrs", LOOPBACK,
                            "--ready-file", str(ready), *extra], "node", stdout=subprocess.DEVNULL)
        peer.ready_file = ready  # type: ignore[attr-defined]
        if wait:
            self.wait_ready(peer)
        return peer

    def wait_ready(self, peer: Peer, timeout_s: float = START_TIMEOUT_S) -> Peer:
        ready: Path = peer.ready_file  # type: ignore[attr-defined]

        def check():
            if peer.process.poll() is not None:
                raise RuntimeError(f"node exited with {peer.process.returncode}:\n{peer.log()[-3000:]}")
            return ready.exists()

        wait_until(check, timeout_s, "a node to become active")
        info = json.loads(ready.read_text())
        peer.maddrs, peer.peer_id, peer.stage = info["maddrs"], info["peer_id"], info["stage"]
        return peer

    def status(self, initial_peer: str, *extra: str, timeout_s: float = 60.0) -> dict:
        result = subprocess.run(shoal_command("status", "--initial-peers", initial_peer, "--json", *extra),
                                capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"shoal status failed: {result.stderr}")
        return json.loads(result.stdout)

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> None:
        if peer.process.poll() is None:
            os.kill(peer.pid, sig)

    def stop(self, peer: Peer, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        self.kill(peer, signal.SIGTERM)
        return peer.process.wait(timeout=timeout_s)

    def close(self) -> None:
        for peer in self.peers:
            if peer.process.poll() is None:
                os.kill(peer.pid, signal.SIGKILL)
        for peer in self.peers:
            try:
                peer.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if peer.process.stdout is not None:
                peer.process.stdout.close()
