"""The fate of every microbatch a data node injects: completed, or abandoned with a reason.

No work is lost silently: `injected == completed + abandoned + in_flight` always, and a data node
reports these counts, by kind of reason (`AbandonReason`) with the latest reasons in words, when it
finishes.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from shoal.node.engine import AbandonReason

DETAILS_KEPT = 16  # the latest abandon reasons kept in words (the counts by kind are complete)


@dataclass
class MicrobatchLedger:
    injected: int = 0
    completed: int = 0
    abandoned: int = 0
    reasons: Counter[AbandonReason] = field(default_factory=Counter)
    details: deque[str] = field(default_factory=lambda: deque(maxlen=DETAILS_KEPT))
    resent: int = 0  # forward passes sent again after a hop was lost before the activation came home
    recoveries: int = 0  # lost backward hops this data node had redone (the hops report their own)
    resumed: int = 0  # forward passes resumed from the nearest upstream hop after a hop was lost in them
    wasted_s: float = 0.0  # in-flight seconds of the forward passes that had to be sent again
    _open: set[str] = field(default_factory=set)

    def inject(self, microbatch_id: str) -> None:
        if microbatch_id in self._open:
            raise ValueError(f"microbatch {microbatch_id} injected twice")
        self._open.add(microbatch_id)
        self.injected += 1

    def is_open(self, microbatch_id: str) -> bool:
        return microbatch_id in self._open

    def complete(self, microbatch_id: str) -> bool:
        """Mark done; False if it had already ended (a late duplicate), which changes nothing."""
        if microbatch_id not in self._open:
            return False
        self._open.remove(microbatch_id)
        self.completed += 1
        return True

    def abandon(self, microbatch_id: str, reason: AbandonReason, detail: str = "") -> bool:
        """Give it up for `reason` (`detail`: the words a person reads); False if it had already ended."""
        if microbatch_id not in self._open:
            return False
        self._open.remove(microbatch_id)
        self.abandoned += 1
        self.reasons[AbandonReason(reason)] += 1
        self.details.append(f"{microbatch_id}: {detail or reason.value}")
        return True

    def resend(self, wasted_s: float) -> None:
        self.resent += 1
        self.wasted_s += wasted_s

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def summary(self) -> dict:
        return {
            "microbatches_injected": self.injected,
            "microbatches_completed": self.completed,
            "microbatches_abandoned": self.abandoned,
            "abandoned_reasons": {reason.value: count for reason, count in sorted(self.reasons.items())},
            "abandoned_details": list(self.details),
            "microbatches_in_flight": self.in_flight,
            "microbatches_resent": self.resent,
            "backward_recoveries": self.recoveries,
            "microbatches_resumed": self.resumed,
            "resend_wasted_s": round(self.wasted_s, 3),
        }
