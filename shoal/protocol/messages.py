"""The control messages every daemon speaks: liveness and errors.

Pipeline messages (forward/backward headers) live in ``pipeline.py`` and register themselves the same
way, with ``@message("tag")``; tensors themselves travel as ``TensorHeader`` plus raw chunks.
"""

from __future__ import annotations

from .errors import ProtocolError, error_for_code
from .limits import MAX_ERROR_CHARS
from .registry import message
from .schema import wire_field


@message("ping")
class Ping:
    """Are you there? ``sent_at`` is the caller's clock, echoed back, so RTT needs no clock sync."""

    sent_at: float
    nonce: int


@message("pong")
class Pong:
    """The answer to a Ping: the echoed ``sent_at``/``nonce`` plus what the caller needs to route to us."""

    sent_at: float
    nonce: int
    peer_state: str = wire_field(max_len=32)
    stage: int
    protocol_version: int


@message("error")
class ErrorReply:
    """What a handler sends back instead of a result: a stable ``code`` and one line of text."""

    code: str = wire_field(max_len=64)
    message: str = wire_field(max_len=MAX_ERROR_CHARS)

    @classmethod
    def from_error(cls, error: ProtocolError) -> ErrorReply:
        """The reply for a refused request (the message is already one bounded line)."""
        return cls(code=error.error_code, message=error.message)

    def to_error(self) -> ProtocolError:
        """The typed error the peer reported, for the caller to raise."""
        return error_for_code(self.code, self.message)


@message("relay_open")
class RelayOpen:
    """To a relay: open `protocol` at peer `to` (a node behind NAT that keeps a connection to you) and
    carry this stream's bytes both ways (shoal/p2p/stream_relay.py)."""

    to: str = wire_field(min_len=1, max_len=128, pattern=r"[A-Za-z0-9]+")
    protocol: str = wire_field(min_len=1, max_len=128, pattern=r"[A-Za-z0-9._/-]+")


@message("relayed_from")
class RelayedFrom:
    """From a relay to the node behind NAT: this stream comes from `origin` (the relay's own
    authenticated connection to it says so), for `protocol`."""

    origin: str = wire_field(min_len=1, max_len=128, pattern=r"[A-Za-z0-9]+")
    protocol: str = wire_field(min_len=1, max_len=128, pattern=r"[A-Za-z0-9._/-]+")


@message("reach")
class ReachRequest:
    """Can you open a TCP connection to me at these addresses? (The reachability self-check.) The
    receiver dials only addresses at the IP this request came from, so nobody can make a peer scan
    third parties."""

    maddrs: tuple[str, ...] = wire_field(max_len=4)


@message("reach_reply")
class ReachReply:
    """Per address asked: "reachable", "unreachable" or "not checked" (and why); plus the address the
    request was seen to come from, which tells a node behind NAT its public IP."""

    results: tuple[str, ...] = wire_field(max_len=4)
    observed: str = wire_field(max_len=200)
