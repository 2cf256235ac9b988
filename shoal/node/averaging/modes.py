"""The averager each `[averaging] mode` runs (none: replicas never share weights)."""

from __future__ import annotations

from shoal.node.averaging.base import Averager
from shoal.node.averaging.diloco import DiLoCoAverager
from shoal.node.averaging.noloco import NoLoCoAverager

AVERAGERS: dict[str, type[Averager]] = {"noloco": NoLoCoAverager, "diloco": DiLoCoAverager}
