"""Data nodes average stage 0's gradients before each optimizer step (`[averaging] stage0 = "gradients"`,
the default; the why is in shoal/train/gradient_mean.py).

At step t a data node pairs with another data node as NoLoCo pairs replicas (a permutation seeded by
run, stage 0 and t: with two data nodes, always each other), and the two swap their gradients over
`rpc_gradient_share`: the lower id calls, the other answers whoever asks first. Both step on the same
mean. A data node with no partner in time, or whose partner's gradients are refused, steps on its own
and never waits on the swarm longer than the run's exchange timeout; one whose partner has passed its
step (a joiner: the others stepped on while it copied stage 0 and AdamW's moments) steps alone at once
until it catches up. Stage 0's weights are still averaged every `stage0_resync_every` steps by the
node's averager, which brings back together replicas that a missed exchange, or a join, set apart.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from shoal.node.averaging.base import exchange_timeout_s
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.node.pipeline.worker.step_window import STEP_HEADROOM
from shoal.node.stage.copy import StageHolder
from shoal.p2p.streams import FramedStream, read_reply
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import Ack, GradientShare
from shoal.protocol.tensors import TensorSpec
from shoal.train.gradient_mean import gradient_refusal, gradients_of, mean_of, set_gradients
from shoal.train.outer import check_partner_tensors, noloco_partner
from shoal.train.outer_codec import OuterCodec

logger = logging.getLogger(__name__)

STAGE = 0
OVER = "is over here"  # the end of the refusal of a call for a step we have passed


class Behind(Exception):
    """Our partner has passed the step we are at: we step alone until we catch up, without waiting."""


class GradientExchange:
    def __init__(self, ctx: NodeContext, holder: StageHolder):
        averaging, self.ctx, self.holder = ctx.run.averaging, ctx, holder
        self.timeout_s = exchange_timeout_s(ctx.run)
        self.codec = OuterCodec("int8" if averaging.codec == "topk" else averaging.codec)
        self.robust, self.tolerance = ctx.run.defense.robust_outer, ctx.run.defense.outer_tolerance
        self.shapes = [tuple(p.shape) for p in holder.module.parameters()]
        self.error: list[torch.Tensor] | None = None  # what our int8 gradients left out, sent next step
        self.step = -1  # the last step exchanged for (or given up): later calls for it are refused
        self.called_for = -1  # the latest step a partner's call asked us for: beyond ours, we are behind
        self._offer: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None  # (step, pieces, sent)
        self._answered: asyncio.Future | None = None
        self._news = asyncio.Condition()  # notified when our offer or our step changes: a waiting call looks again
        self.shared = 0  # steps taken on a pair's mean
        self.alone = 0  # steps with other data nodes about but no partner's gradients taken
        self.behind = 0  # ... of which our partner had passed the step (a joiner catching up)
        self.refused: dict[str, str] = {}  # partner -> why its gradients were not taken, latest
        self.bytes_sent = 0
        self.exchange_s: list[float] = []

    def _replicas(self) -> list[str]:
        view = self.ctx.view
        peers = [n.peer_id for n in view.replicas(STAGE) if n.state == "active"] if view else []
        return peers if self.ctx.peer_id in peers else [*peers, self.ctx.peer_id]

    async def exchange(self, step: int) -> bool:
        """Before our optimizer step of `step`: replace stage 0's gradients with our pair's mean.
        Returns whether a partner's gradients were taken."""
        replicas = self._replicas()
        if len(replicas) < 2:  # the only data node: nothing to send, nothing to wait for
            self.step = step
            return False
        partner = noloco_partner(self.ctx.run.run_id, STAGE, step, replicas, self.ctx.peer_id)
        own = await self.holder.compute(gradients_of, self.holder.module, priority=BACKWARD)
        pieces, sent, error = await self.holder.compute(self.codec.encode_delta, own, self.error, priority=BACKWARD)
        loop = asyncio.get_running_loop()
        self._answered = loop.create_future()
        await self._publish((step, pieces, sent), self.step)
        started, theirs = time.monotonic(), None
        try:
            # the odd one out (partner None) steps on its own, unless a data node whose view differs called
            if partner is not None and self.ctx.peer_id < partner:
                theirs = await self._call(partner, step, pieces) or await self._wait_for_call(step)
            elif partner is not None:
                theirs = await self._wait_for_call(step) or await self._call(partner, step, pieces)
        except Behind as e:
            self.behind += 1
            logger.info("[%s] step %d: %s; our own gradients until we catch up", self.ctx.short_id, step, e)
        except Exception as e:  # unreachable, a broken stream, bad tensors: our own gradients
            logger.info("[%s] step %d: gradient exchange failed (%r)", self.ctx.short_id, step, e)
        finally:
            await self._publish(None, max(self.step, step))
        if theirs is None and self._answered.done():
            theirs = self._answered.result()
        if theirs is None:
            logger.info("[%s] step %d: no data node's gradients in time; our own", self.ctx.short_id, step)
        elif await self._take(step, sent, *theirs):
            self.error = error
            self.exchange_s.append(time.monotonic() - started)
            return True
        self.alone += 1
        return False

    async def _take(self, step: int, sent: list[torch.Tensor], theirs: list[torch.Tensor], sender: str) -> bool:
        """Step on the mean of `sent` (ours, as the partner decoded it) and `theirs`, unless screened out."""
        clip = self.ctx.run.optim.grad_clip
        why = gradient_refusal(sent, theirs, self.tolerance, clip) if self.robust else None
        if why is not None:
            self.refused[sender] = why
            logger.warning("[%s] step %d: stage-0 gradients of %s refused: %s", self.ctx.short_id, step,
                           sender[-8:], why)  # fmt: skip
            return False
        mean = await self.holder.compute(mean_of, sent, theirs, priority=BACKWARD)
        await self.holder.compute(set_gradients, self.holder.module, mean, priority=BACKWARD)
        self.shared += 1
        return True

    async def _wait_for_call(self, step: int):
        """A partner's gradients if it calls for `step` within a third of the exchange timeout (our views
        of who pairs with whom may differ); raises Behind if a call for a later step comes meanwhile."""
        answered = self._answered
        assert answered is not None

        def heard() -> bool:
            return answered.done() or self.called_for > step

        async with self._news:
            try:
                await asyncio.wait_for(self._news.wait_for(heard), self.timeout_s / 3)
            except TimeoutError:
                return None
        if answered.done():
            return answered.result()
        raise Behind(f"a partner called for step {self.called_for}")

    async def _call(self, partner: str, step: int, pieces: list[torch.Tensor]):
        try:
            stream = await self.ctx.rpc.gradient_share.open(partner, self.timeout_s)
        except Exception as e:
            self.ctx.suspects.mark(partner, f"gradient share dial failed: {e!r}")
            raise
        try:
            await stream.write_message(GradientShare(step=step, tensors=len(self.shapes)))
            await self._send(stream, pieces)
            ack = await read_reply(stream, Ack)
            if not ack.accepted:
                if ack.reason.endswith(OVER):
                    raise Behind(f"{partner[-8:]} is past step {step}")
                logger.info("[%s] step %d: %s declined our gradients: %s", self.ctx.short_id, step, partner[-8:],
                            ack.reason)  # fmt: skip
                return None
            return await self._receive(stream), partner
        finally:
            stream.close()

    async def on_share(self, request: GradientShare, stream: FramedStream, sender: str) -> Ack | None:
        """Another data node's gradients for `request.step`: read them, then answer with ours once we
        are at that step (within the exchange timeout)."""
        theirs = await self._receive(stream)  # read first: a refusal must not leave the sender blocked
        reason = self._refusal(request, sender)
        found = None
        if reason is None:
            async with self._news:  # we may be behind: a wait for a call for an earlier step gives up
                self.called_for = max(self.called_for, request.step)
                self._news.notify_all()
            found = await self._wait_for_offer(request.step)
            reason = None if found is not None else f"not at step {request.step} in time"
        if reason is not None:
            return Ack(accepted=False, reason=reason)
        assert found is not None
        (_, pieces, _), answered = found
        self._offer = None  # one exchange per step
        await stream.write_message(Ack(accepted=True))
        await self._send(stream, pieces)
        async with self._news:
            if not answered.done():  # that step's exchange, even if ours has given up on it meanwhile
                answered.set_result((theirs, sender))
            self._news.notify_all()
        return None

    def _refusal(self, request: GradientShare, sender: str) -> str | None:
        if request.tensors != len(self.shapes):
            return f"expected {len(self.shapes)} tensors, got {request.tensors}"
        view = self.ctx.view
        if view is None or sender not in {n.peer_id for n in view.replicas(STAGE)}:
            return "not a live data node of this run"
        if request.step <= self.step:
            return f"step {request.step} {OVER}"
        highest = self.highest()
        if request.step > highest:
            return f"step {request.step} is beyond any this data node can vouch for (at most {highest})"
        return None

    def highest(self) -> int:
        """The latest step a partner may call for: ours (the next we step, or the next after the last we
        exchanged for) plus STEP_HEADROOM, as a worker's step window (step_window.py) bounds what a data
        node names, and never past the run's last step. A call beyond it would set `called_for` past
        every step we take, and we would step alone from then on."""
        ours = max(self.step + 1, self.holder.optimizer.step_count)
        return min(self.ctx.run.train.steps - 1, ours + STEP_HEADROOM)

    async def _publish(self, offer: tuple | None, step: int) -> None:
        async with self._news:
            self._offer, self.step = offer, step
            self._news.notify_all()

    async def _wait_for_offer(self, step: int):
        """Our offer and its exchange's future once we reach `step` (None if we pass it, or not in time)."""

        def ready() -> bool:
            return self.step >= step or (self._offer is not None and self._offer[0] == step)

        async with self._news:
            try:
                await asyncio.wait_for(self._news.wait_for(ready), self.timeout_s)
            except TimeoutError:
                return None
            if self._offer is not None and self._offer[0] == step and self._answered is not None:
                return self._offer, self._answered
        return None

    async def _send(self, stream: FramedStream, pieces: list[torch.Tensor]) -> None:
        for piece in pieces:
            self.bytes_sent += await stream.write_exact(piece, str(piece.dtype).removeprefix("torch."))

    async def _receive(self, stream: FramedStream) -> list[torch.Tensor]:
        device = next(self.holder.module.parameters()).device
        pieces = []
        for want in self.codec.delta_specs(self.shapes):
            spec = TensorSpec(want.dtype, want.shape, want.max_abs)
            pieces.append(await stream.read_exact(spec, max_bytes=max(1, want.nbytes), device=device))
        grads = self.codec.decode_delta(pieces, self.shapes)
        reference = [torch.empty(s, device=device) for s in self.shapes]
        try:
            check_partner_tensors(grads, reference, "partner gradients", dtype=torch.float32)
        except BadTensor as e:
            logger.warning("[%s] refused stage-0 gradients: %s", self.ctx.short_id, e)
            raise
        return grads

    def stats(self) -> dict:
        return {
            "codec": self.codec.name,
            "shared": self.shared,
            "alone": self.alone,
            "behind": self.behind,
            "refused": dict(self.refused),
            "bytes_sent": self.bytes_sent,
            "bytes_per_exchange": sum(s.nbytes for s in self.codec.delta_specs(self.shapes)),
            "exchange_s": [round(t, 4) for t in self.exchange_s],
        }
