"""How much one relayed connection may carry, and for how long, before the relay cuts it.

A node behind NAT serves its stage through a relay peer (libp2p circuit relay v2). The relay resets a
relayed connection once it has carried its data limit in either direction or been open its time
limit: p2pd's defaults are 4 GiB and 30 minutes, libp2p's own 128 KiB and 2 minutes. A connection
that is cut is dialed again and the hop that was on it is sent again (nothing is lost), but a limit
the run reaches every few minutes would keep costing that. So a relay that knows the run sets its
data limit to what one pair of nodes can exchange in the whole run, times SLACK: every microbatch's
activations (forward) or their gradients (backward) at float32, plus the whole model's weights for
each outer exchange and a stage copy. One that does not (a bootstrap peer serving any run) keeps the
floor. The time limit is a day: a relayed connection that lives that long is simply dialed again.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.planning.time_limits import SLACK

FLOOR_DATA_BYTES = 4 << 30  # p2pd's own default, per direction and connection
TIME_LIMIT_S = 24 * 3600.0


@dataclass(frozen=True)
class RelayLimits:
    data_bytes: int  # per relayed connection and direction
    time_s: float  # per relayed connection

    def p2pd_flags(self) -> dict[str, str]:
        return {"relayDataLimit": str(self.data_bytes), "relayTimeLimit": f"{int(self.time_s)}s"}


def relay_limits(pipeline_bytes: float = 0.0, weights_bytes: float = 0.0) -> RelayLimits:
    """Limits for a run whose pair of nodes exchanges `pipeline_bytes` of activations or gradients and
    `weights_bytes` of weights in all (0, 0: a run the relay does not know)."""
    return RelayLimits(max(FLOOR_DATA_BYTES, int(SLACK * (pipeline_bytes + weights_bytes))), TIME_LIMIT_S)
