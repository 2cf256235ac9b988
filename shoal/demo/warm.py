"""Start `shoal` commands as processes forked from one warm parent.

A fresh interpreter spends ~2.7 CPU-seconds importing torch, hivemind and scipy before a node does
anything; a local swarm of five nodes on a two-core laptop spends most of its start-up there. Here a
forkserver (Python's `multiprocessing`, the same mechanism a torch DataLoader uses) imports them
once, and every peer is a fork of it: a real, separate process with its own p2pd, its own DHT node
and its own pid, which the launcher signals and waits for as it would a `subprocess.Popen`.

Only the launcher's own processes on this machine use it; nothing here crosses the network.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# What every peer imports before it does anything; the forkserver imports it once.
PRELOAD = ["torch", "hivemind.dht", "hivemind.p2p", "shoal.cli", "shoal.node.daemon", "shoal.bootstrap.command"]

_context: multiprocessing.context.BaseContext | None = None


def available() -> bool:
    return sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _end_with_parent() -> None:
    """Ask Linux for SIGTERM when the parent (the forkserver, which ends with the launcher) dies, so
    a launcher killed without cleaning up leaves no node running."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run_command(argv: list[str], env: dict[str, str], cwd: str, stdout_path: str, stderr_path: str) -> None:
    """In the forked child: become a fresh `shoal` process with this environment and these files."""
    _end_with_parent()
    # multiprocessing made the forkserver this child's default; a fresh interpreter's is "fork", and
    # hivemind's averager starts its own processes with the default.
    multiprocessing.set_start_method("fork", force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True, write_through=True)
    sys.argv = ["shoal", *argv]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)

    from shoal.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class WarmProcess:
    """The part of `subprocess.Popen` the launcher uses, for a process forked from the warm parent."""

    def __init__(self, argv: list[str], stdout_path: Path, stderr_path: Path, env: dict[str, str] | None = None):
        self.args = argv
        self._process = _forkserver().Process(
            target=_run_command,
            args=(argv, dict(env if env is not None else os.environ), os.getcwd(), str(stdout_path), str(stderr_path)),
            daemon=False,
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.stdout = None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def first_line(path: Path, process: WarmProcess | subprocess.Popen, timeout_s: float) -> str:
    """The first complete line a process writes to its stdout file (empty if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if "\n" in text:
            return text.split("\n", 1)[0].strip()
        if process.poll() is not None:
            return text.strip()
        time.sleep(0.02)
    return ""
