"""Run reports: `report.json` and `loss.png`, written atomically into a folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.files import atomic_save, atomic_write


def write_json_atomic(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def plot_curves(
    path: Path,
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    marks: Sequence[tuple[float, str]] = (),
    xlabel: str = "step",
    ylabel: str = "loss (nats/token)",
    marker: str | None = None,
) -> None:
    """One line per curve name: (x values, y values); a dashed vertical line per mark (x, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=name, linewidth=1.2, marker=marker)
    grouped: dict[float, list[str]] = {}
    for x, label in marks:  # events at the same step share one line and one label
        grouped.setdefault(x, []).append(label)
    for x, labels in grouped.items():
        label = "; ".join(labels)
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.9)
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.tight_layout()
    atomic_save(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".tmp.png")
    plt.close(fig)


def write_report(
    directory: str | Path,
    report: dict[str, Any],
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    marks: Sequence[tuple[float, str]] = (),
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plot_curves(directory / "loss.png", curves, title, marks)
    write_json_atomic(directory / "report.json", report)  # last: its presence marks a complete report
    return directory / "report.json"
