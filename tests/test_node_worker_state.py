"""A stage worker's per-microbatch and per-step state on its own, without a worker or a peer: the
step clock (shoal/node/pipeline/worker/step_clock.py), how long it waits for a close (waits.py) and
the kept state (kept.py)."""

from __future__ import annotations

import asyncio
import time

import torch

from shoal.node.config import LimitOptions
from shoal.node.pipeline.worker import step_clock
from shoal.node.pipeline.worker import waits as waits_module
from shoal.node.pipeline.worker.kept import KeptState, Saved, SentGradient
from shoal.node.pipeline.worker.step_clock import StepClock
from shoal.node.pipeline.worker.waits import CloseWaits
from shoal.protocol.pipeline import BackwardRequest, ForwardRequest, Hop

A, B = "QmDataNodeA", "QmDataNodeB"


def test_the_inner_step_is_due_once_every_contributor_closed_the_step_its_gradient_belongs_to() -> None:
    async def main() -> None:
        clock = StepClock(patience_s=1.0, short_id="test")
        assert not clock.step_due()  # nothing accumulated: nothing to step
        clock.contributed(A, 3)
        clock.contributed(B, 5)
        clock.contributed(A, 2)  # an older step's late gradient does not move A's back
        await clock.mark_heard(A, 3)
        assert not clock.step_due()  # B's step 5 is still open
        await clock.mark_heard(B, 4)
        assert not clock.step_due()
        await clock.mark_heard(B, 5)
        assert clock.step_due()
        clock.step_taken()
        assert not clock.step_due() and clock.contributors == {}

    asyncio.run(main())


def test_the_inner_step_waits_for_a_contributors_close_only_while_it_is_listed_and_within_its_bounds() -> None:
    """waits.py's rule: a contributor no view lists is released at once, one that another data node's
    closes have left CLOSE_LAG_STEPS behind is released, and so is one whose close is `wait_s` late;
    the gradient they contributed stays, and the step is due on the closes of the others."""

    class Listing:  # what CloseWaits asks of Admission
        async def unlisted(self, peer_id: str, since: float) -> bool:
            return peer_id not in (A, B)

    class Weights:  # ... and of Stepper
        def weights_free(self) -> bool:
            return True

        async def maybe_step(self) -> None:
            pass

    async def main() -> None:
        clock = StepClock(patience_s=1.0, short_id="test")
        kept = KeptState(LimitOptions(), lambda: None)
        waits = CloseWaits(clock, Listing(), kept, Weights(), wait_s=0.2)  # type: ignore[arg-type]
        for origin, step in ((A, 3), (B, 3), ("QmStranger", 0)):
            clock.contributed(origin, step)
        await waits.settle()
        assert clock.awaited() == {A: 3, B: 3}  # the stranger no longer holds the step
        await clock.mark_heard(A, 3 + waits_module.CLOSE_LAG_STEPS)
        await waits.settle()
        assert clock.awaited() == {} and clock.step_due()  # B is too far behind A to be waited for
        clock.step_taken()
        clock.contributed(B, 7)
        await waits.settle()
        assert clock.awaited() == {B: 7}
        await asyncio.sleep(0.25)
        await waits.settle()
        assert clock.awaited() == {}  # B's close is late

    asyncio.run(main())


def test_a_close_is_new_sent_again_while_handled_or_overtaken_by_a_later_one() -> None:
    async def main() -> None:
        clock = StepClock(patience_s=1.0, short_id="test")
        assert not clock.sent_again(A, 0) and not clock.overtaken(A, 0)
        await clock.mark_heard(A, 0)
        assert clock.sent_again(A, 0)  # heard, not yet handled
        await clock.mark_handled(A, 0)
        assert not clock.sent_again(A, 0)  # handled: a close sent again is handled as any
        await clock.mark_heard(A, 2)
        await clock.mark_handled(A, 2)
        assert clock.overtaken(A, 1) and not clock.overtaken(A, 2)
        clock.contributed(A, 3)
        clock.forget(A)  # A restarted: its new process counts anew
        assert not clock.overtaken(A, 1) and clock.contributors == {} and A not in clock.heard

    asyncio.run(main())


def test_a_forward_waits_for_its_data_nodes_previous_close_to_be_handled_and_no_longer(monkeypatch) -> None:
    def forward(step: int, origin: str = A) -> ForwardRequest:
        return ForwardRequest(microbatch_id=f"m{step}", origin=origin, step=step, hop=0, route=(Hop(1, "QmUs"),))

    async def main() -> None:
        clock = StepClock(patience_s=1.0, short_id="test")
        await asyncio.wait_for(clock.after_previous_close(forward(1)), 0.1)  # a data node never served: no wait
        clock.contributed(A, 0)
        held = asyncio.ensure_future(clock.after_previous_close(forward(1)))
        await asyncio.sleep(0.05)
        assert not held.done()  # step 0's close has not come
        await clock.mark_heard(A, 0)
        await asyncio.sleep(0.05)
        assert not held.done()  # ... nor been handled
        await clock.mark_handled(A, 0)
        await asyncio.wait_for(held, 0.5)
        started = time.monotonic()
        await clock.after_previous_close(forward(2))  # step 1's close never comes: the forward goes ahead
        assert time.monotonic() - started >= step_clock.CLOSE_OVERTAKEN_WAIT_S * 0.5

    monkeypatch.setattr(step_clock, "CLOSE_OVERTAKEN_WAIT_S", 0.2)
    asyncio.run(main())


def test_kept_state_ends_with_its_data_nodes_step_and_a_dropped_graph_is_reported() -> None:
    dropped: list[None] = []
    kept = KeptState(LimitOptions(), lambda: dropped.append(None))
    x = torch.zeros(1, 2, 4)
    for mb, origin, step in (("a1", A, 1), ("a2", A, 2), ("b1", B, 1)):
        kept.saved[mb] = Saved(x, x, kept.expiry(), origin, 0, step, None)
        request = BackwardRequest(microbatch_id=mb, origin=origin, step=step, hop=0, route=(Hop(1, "QmUs"),))
        kept.sent[mb] = SentGradient(request, x, kept.expiry())
    assert kept.ran_forward("a1") and kept.saved["b1"].origin == B
    assert kept.close(A, 1) == 1 and len(dropped) == 1  # a1's graph: no gradient will reach it now
    assert set(kept.saved) == {"a2", "b1"} and set(kept.sent) == {"a2", "b1"}
    assert kept.forget_origin(B) == 1 and len(dropped) == 2 and set(kept.sent) == {"a2"}
    kept.saved["a2"].expires_at = kept.sent["a2"].expires_at = time.monotonic() - 1
    kept.backward_done["a0"] = time.monotonic() - 1
    assert kept.expire() == 1 and kept.expired == 1 and len(dropped) == 3
    assert not kept.saved and not kept.sent and not kept.backward_done
