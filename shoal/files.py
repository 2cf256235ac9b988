"""Writing a file so that a reader, or a process killed mid-write, never sees half of it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def atomic_save(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp", durable: bool = False) -> Path:
    """Have `write` fill a temporary file beside `path` (same folder, so the rename is atomic), then
    rename it over `path`. `suffix` keeps the extension a writer may go by (matplotlib does).
    `durable`: the file and the rename are fsynced, so a power cut leaves the old or the new content."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}{suffix}")
    try:
        write(tmp)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(target.parent)
    return target


def fsync_path(path: Path) -> None:
    """fsync a file's content, or a folder's entries (after a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes, mode: int | None = None, durable: bool = False) -> Path:
    """`data` as the whole new content of `path`; `mode` (e.g. 0o600 for a key) from the first byte on."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)

    return atomic_save(path, write, durable=durable)
