"""The averager each `[averaging] mode` runs: one line per method (none: replicas never share weights).
A test holds this table and the run config's `AVERAGING_MODES` to the same names."""

from __future__ import annotations

from shoal.config import AveragingConfig
from shoal.node.averaging.base import Averager
from shoal.node.averaging.diloco import DiLoCoAverager
from shoal.node.averaging.noloco import NoLoCoAverager
from shoal.train.outer import OuterConfig

AVERAGERS: dict[str, type[Averager] | None] = {"noloco": NoLoCoAverager, "diloco": DiLoCoAverager, "none": None}


def outer_config(averaging: AveragingConfig, stage: int) -> OuterConfig:
    """The outer step a replica of `stage` takes under the run's averaging."""
    averager = AVERAGERS[averaging.mode]
    if averager is None:
        raise ValueError(f"averaging mode {averaging.mode!r} takes no outer step")
    return averager.outer_config(averaging, stage)
