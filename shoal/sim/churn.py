"""Churn as seeded random processes: crashes, graceful leaves and joins, arriving as Poisson processes.

Churn takes block-stage nodes only, unless `data_nodes` says otherwise: a data node is where the
volunteer's own data and loss live, and the joiners that replace what churn takes only ever serve
block stages, so a churn model that also drained data nodes would shrink the swarm's injection
capacity for the whole run and amplify whichever policy is slower rather than measure it.

Crash and leave events arrive at `rate_per_node_hour` x the initial number of nodes churn may take
(block-stage nodes, or every node with `data_nodes`) per hour; each picks one such live node
uniformly when it fires, which approximates one Poisson process per node while joins keep the swarm
near its size. `crash_share` of them are crashes. Joins arrive at the same total rate unless told
otherwise. Event times are continuous, so crashes land wherever a node happens to be, including
mid-forward and mid-backward; the simulator counts where each one landed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ChurnConfig:
    rate_per_node_hour: float = 0.0  # crash + leave events per node churn may take, per hour
    crash_share: float = 2.0 / 3.0  # the rest are graceful leaves
    join_per_node_hour: float | None = None  # None: the same as rate_per_node_hour
    data_nodes: bool = False  # True: data nodes crash and leave too (joiners still take block stages only)

    def __post_init__(self) -> None:
        if self.rate_per_node_hour < 0 or not 0 <= self.crash_share <= 1:
            raise ValueError("churn rate must be >= 0 and crash share in [0, 1]")


@dataclass(frozen=True)
class ChurnEvent:
    time_s: float
    kind: str  # "crash", "leave" or "join"
    pick: float  # uniform in [0, 1): which live node (crash, leave) or which newcomer draw (join)


class ChurnProcess:
    """Yields churn events in time order from its own seeded generator.

    `initial_nodes` is how many nodes churn may take at the start (see the module's docstring)."""

    def __init__(self, config: ChurnConfig, initial_nodes: int, rng: random.Random) -> None:
        self.rng = rng
        self.config = config
        self.departure_rate = config.rate_per_node_hour * initial_nodes / 3600.0
        joins = config.rate_per_node_hour if config.join_per_node_hour is None else config.join_per_node_hour
        self.join_rate = joins * initial_nodes / 3600.0
        self._next_departure = self._draw(0.0, self.departure_rate)
        self._next_join = self._draw(0.0, self.join_rate)

    def _draw(self, after: float, rate: float) -> float:
        return after + self.rng.expovariate(rate) if rate > 0 else float("inf")

    def next_event(self) -> ChurnEvent | None:
        if self._next_departure == float("inf") and self._next_join == float("inf"):
            return None
        if self._next_departure <= self._next_join:
            t = self._next_departure
            self._next_departure = self._draw(t, self.departure_rate)
            kind = "crash" if self.rng.random() < self.config.crash_share else "leave"
            return ChurnEvent(t, kind, self.rng.random())
        t = self._next_join
        self._next_join = self._draw(t, self.join_rate)
        return ChurnEvent(t, "join", self.rng.random())
