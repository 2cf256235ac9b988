"""What a stage worker keeps of each microbatch, and until when (and the AbandonNotice that releases it).

Forward keeps the input and output of a training microbatch, with its graph, until its gradient
comes back (`Saved`). Backward keeps the gradient it passed upstream until the microbatch is over
(`SentGradient`): if the hop before ours dies holding its graph, another replica of that stage redoes
it from that gradient. Which forwards and backwards already ran is kept a while longer, so that a
retried request is taken as done. A microbatch is over when its data node gives it up, closes its
step, restarts or leaves our view (waits.py), or when what we keep of it expires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.model.split_backward import LinearCall
from shoal.node.config import LimitOptions
from shoal.protocol.pipeline import AbandonNotice, Ack, BackwardRequest


@dataclass
class Saved:
    x: torch.Tensor  # the input, requiring grad
    y: torch.Tensor  # the output, with its graph
    expires_at: float
    origin: str  # the data node that owns the microbatch (the only peer that may release it)
    hop: int  # this node's position in the microbatch's route
    step: int  # the data node's step it belongs to: once that step is closed, no gradient can come
    next_stage: int | None  # the stage we passed the output to (None: the data node)
    next_peer: str | None = None  # the peer that took it (set once it acknowledged)
    calls: list[LinearCall] = field(default_factory=list)  # the forward's Linear calls, for the B/W split
    tokens: bytes = b""  # the microbatch's token ids as they came (a Subspace Network's run)
    taken_at: float = field(default_factory=time.monotonic)


@dataclass
class SentGradient:
    """A gradient this node passed upstream, kept until the microbatch is over (see RecoverRequest): its
    data node closes its step, gives it up, or it expires."""

    request: BackwardRequest  # what was sent, its route as sent
    grad: torch.Tensor
    expires_at: float
    tokens: bytes = b""  # the microbatch's token ids, for whoever redoes the hop before ours


class KeptState:
    """The per-microbatch memory of a stage worker, keyed by microbatch id. Every `Saved` holds a live
    forward graph: dropping one calls `graph_dropped`, since a pending inner step may wait for it."""

    def __init__(self, limits: LimitOptions, graph_dropped: Callable[[], None]) -> None:
        self.limits = limits
        self.graph_dropped = graph_dropped
        self.saved: dict[str, Saved] = {}
        self.sent: dict[str, SentGradient] = {}
        self.backward_done: dict[str, float] = {}  # microbatch id -> when to forget it
        self.forwarded: dict[str, float] = {}  # microbatch id -> when to forget that we ran its forward
        self.expired = 0

    def expiry(self) -> float:
        """How long to keep what a microbatch may still need: its own timeout, plus the time a hop
        after ours may spend waiting for a replica of a stage that has none (a redo then needs it)."""
        return time.monotonic() + self.limits.microbatch_timeout_s + self.limits.stage_wait_s

    def ran_forward(self, microbatch_id: str) -> bool:
        """Whether we already ran this microbatch's forward (a retried stream whose ack was lost)."""
        mb = microbatch_id
        return mb in self.forwarded or mb in self.saved or mb in self.backward_done

    def drop(self, microbatch_id: str) -> None:
        """Forget a microbatch whose gradient will never come; a pending step may then proceed."""
        if self.saved.pop(microbatch_id, None) is not None:
            self.graph_dropped()

    def close(self, origin: str, step: int) -> int:
        """Data node `origin` closed `step`: its microbatches of that step and before all came home or
        were given up, so no gradient will reach their graphs and no hop of theirs will need redoing.
        Returns how many graphs were dropped (lost attempts whose release never reached us). Kept until
        expiry instead (3 min), a stage's sent gradients filled ~200 MiB in a 250-step benchmark run."""
        over = [mb for mb, s in self.saved.items() if s.origin == origin and s.step <= step]
        for mb in over:
            self.drop(mb)
        for mb in [mb for mb, kept in self.sent.items() if kept.request.origin == origin and kept.request.step <= step]:
            del self.sent[mb]
        return len(over)

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        """The data node gave this microbatch up (or is done with it): drop what we keep for it."""
        saved = self.saved.get(notice.microbatch_id)
        sent = self.sent.get(notice.microbatch_id)
        if (saved is None or saved.origin != sender) and (sent is None or sent.request.origin != sender):
            return Ack(accepted=False, reason="nothing kept for that microbatch from that data node")
        self.sent.pop(notice.microbatch_id, None)
        self.drop(notice.microbatch_id)
        return Ack(accepted=True)

    def forget_origin(self, origin: str) -> int:
        """A data node restarted under the same peer id (restarts.py) or is no live data node of the
        run (waits.py): none of the microbatches it injected will come back, so drop what we keep for
        them, as if each was abandoned; returns how many graphs were dropped."""
        stale = [mb for mb, s in self.saved.items() if s.origin == origin]
        for mb in stale:
            self.drop(mb)
        for mb in [mb for mb, kept in self.sent.items() if kept.request.origin == origin]:
            del self.sent[mb]
        return len(stale)

    def expire(self) -> int:
        """Drop what we keep for microbatches whose gradient never came (abandoned downstream) or
        whose backward is long over."""
        now = time.monotonic()
        stale = [mb for mb, s in self.saved.items() if s.expires_at < now]
        for mb in stale:
            self.drop(mb)
        self.expired += len(stale)
        for kept in (self.sent, self.backward_done, self.forwarded):
            for mb in [mb for mb, v in kept.items() if (v if isinstance(v, float) else v.expires_at) < now]:
                del kept[mb]
        return len(stale)
