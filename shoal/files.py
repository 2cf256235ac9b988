"""Writing a file so that a reader, or a process killed mid-write, never sees half of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_save(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Have `write` fill a temporary file beside `path` (same folder, so the rename is atomic), then
    rename it over `path`. `suffix` keeps the extension a writer may go by (matplotlib does)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}{suffix}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def atomic_write(path: str | Path, data: str | bytes, mode: int | None = None) -> Path:
    """`data` as the whole new content of `path`; `mode` (e.g. 0o600 for a key) from the first byte on."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)

    return atomic_save(path, write)
