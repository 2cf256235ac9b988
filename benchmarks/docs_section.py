"""Write one benchmark's section of docs/benchmarks.md, between its own markers, leaving the rest."""

from __future__ import annotations

import os
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every number here was measured by a script under `benchmarks/` that compares a capability against its
baseline in one run and writes JSON under `benchmarks/results/`. Machines are shared and noisy (2 CPU
cores): ratios are measured side by side; medians and spread are given where runs repeat.
"""


def write_section(name: str, markdown: str, doc: Path = DOC) -> Path:
    """Replace the section `name` (its headings demoted one level under the page title)."""
    body = "\n".join("#" + line if line.startswith("#") else line for line in markdown.strip().splitlines())
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    text = doc.read_text() if doc.exists() else HEADER
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = doc.with_name(f".{doc.name}.tmp")
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text)
    os.replace(tmp, doc)
    return doc


def wall_time(seconds: float) -> str:
    """A benchmark's run time for its "Reproduce" line: seconds under two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
