"""What every daemon and bootstrap peer answers, whatever it runs: a ping (health.py) and a dial-back
(reachability.py). The engines' RPCs are the node's (`shoal/node/rpcs.py`)."""

from __future__ import annotations

from shoal.p2p.rpc import Rpc, Service
from shoal.protocol.messages import Ping, Pong, ReachReply, ReachRequest


class NodeRpcs(Service):
    ping = Rpc(Ping, Pong)
    reach = Rpc(ReachRequest, ReachReply, streamed=True)  # streamed: the answer needs the caller's address
