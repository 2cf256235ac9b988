"""Reading a data node's progress file (one JSON event per line)."""

from __future__ import annotations

import json
from pathlib import Path


def progress_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_event(path: Path) -> dict | None:
    return next((e for e in progress_events(path) if e["event"] == "done"), None)
