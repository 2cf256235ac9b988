"""NoLoCo in the daemon: every H inner steps a stage replica averages with one random live replica of
its stage over one stream, and both apply the same pair update (shoal/train/outer.py).

The epoch clock is the data node's: its step close for step t ends outer epoch (t + 1) / H when
that divides, and every live worker receives it, so replicas reach an epoch together even when one
of them served no microbatch of the last step. Pairs are drawn from a permutation seeded by (run,
stage, epoch) over the stage's live replicas as each node sees them (as the authors' code pairs
entry k with k + n/2); the lower peer id of a pair calls. A replica accepts one exchange per
epoch, from whoever asks first, so two replicas whose views disagree still pair or fall back
cleanly: a node with no partner before the deadline takes a local outer step and never waits on the
swarm longer than that. Tensors from a partner are checked (count, shape, dtype, finite) before
they touch anything.

Partners first swap a digest of their φ and send φ only where the two differ: replicas that applied
the same pair updates hold the same φ to the bit (two replicas of a stage always do), so the pull
term is zero and φ's bytes, half of a float32 exchange and all of a top-k one's floor, need not
travel. Where they differ φ goes in the run's codec, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time

import torch

from shoal.config import AveragingConfig
from shoal.device import float64
from shoal.logs import printable
from shoal.node.averaging.base import Averager, Replica, outer_codec_name
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.node.engine import OuterStep
from shoal.p2p.streams import FramedStream, read_reply
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import Ack, GossipAccept, GossipRequest
from shoal.protocol.tensors import TensorSpec
from shoal.train.audit import refused_by_partners
from shoal.train.outer import (
    OuterConfig,
    check_partner_tensors,
    load_slow_weights,
    local_step,
    noloco_partner,
    noloco_step,
    pseudo_gradient,
    replica_distance,
)
from shoal.train.outer_codec import OuterCodec
from shoal.train.robust import (
    PartnerVerdict,
    distance,
    epoch_step_bound,
    norm,
    remember,
    screen_partner,
)

logger = logging.getLogger(__name__)

MAX_REFUSALS_LISTED = 16  # partners refused by the robust outer step, as our record lists them
# The odd one out of a stage's pairs (every odd number of replicas has one) waits this long for a call:
# a replica whose view of the stage differs (it just joined, or missed a leave) calls at once if it
# has the lower id. Its step close waits for its outer step, and so does the data node's next step:
# waiting a third of the exchange timeout stalled the whole pipeline 3.3 s at every outer step.
ODD_ONE_OUT_WAIT_S = 0.5


@dataclasses.dataclass(frozen=True, eq=False)
class Offer:
    """What this replica sends for an epoch: φ and Δ as the partner will decode them, their wire
    pieces, and the error feedback that sending them leaves (kept once an exchange goes through)."""

    phi: list[torch.Tensor]
    delta: list[torch.Tensor]
    phi_pieces: list[torch.Tensor]
    delta_pieces: list[torch.Tensor]
    error: list[torch.Tensor] | None
    phi_digest: str  # of the φ it sends (an experiment's hostile replica's, where it alters it)


def phi_digest(phi: list[torch.Tensor]) -> str:
    """SHA-256 of φ's float32 bytes, tensor by tensor, shapes included."""
    digest = hashlib.sha256()
    for p in phi:
        digest.update(repr(tuple(p.shape)).encode())
        digest.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _wire_dtype(piece: torch.Tensor) -> str:
    return str(piece.dtype).removeprefix("torch.")


class NoLoCoAverager(Averager):
    @classmethod
    def method_config(cls, averaging: AveragingConfig) -> OuterConfig:
        return OuterConfig.noloco(
            alpha=averaging.alpha, beta=averaging.beta, gamma=averaging.gamma, inner_steps=averaging.inner_steps
        )

    def __init__(self, ctx: NodeContext, replica: Replica):
        averaging = ctx.run.averaging
        super().__init__(ctx, replica)
        self.codec = OuterCodec(outer_codec_name(averaging, replica.stage), averaging.topk_fraction)
        self.error: list[torch.Tensor] | None = None  # what our compressed Δs left out (outer_codec.py)
        self.bytes_sent = 0  # outer-exchange bytes this replica sent
        self.phi_skipped = 0  # exchanges whose φ did not travel (the partner held the same)
        self._offer: asyncio.Future | None = None  # our Offer for the epoch in progress
        self._offer_epoch = -1
        self._answered: asyncio.Future | None = None  # a partner's (phi, delta), once exchanged
        self.pair_steps = 0
        self.refused = 0
        self.distances: list[tuple[int, float]] = []  # (inner step, ‖θ − θ_partner‖ just before averaging)
        self.screened_out = 0  # partners the robust outer step refused
        self.refusals: dict[str, str] = {}  # partner -> why we last refused it (in our node record)
        self.outer_log: list[OuterStep] = []
        self._taken_from: str | None = None  # whose tensors the outer step in progress received

    @property
    def last_distance(self) -> float | None:
        return self.distances[-1][1] if self.distances else None

    # ---- one outer step ---------------------------------------------------------------------------

    async def _outer_step(self, epoch: int) -> None:
        """Average for `epoch`: with the planned partner, or whoever asks first, or alone."""
        worker = self.worker
        full = await worker.compute(pseudo_gradient, self.state, worker.module, priority=BACKWARD)
        # A fresh list of the stage's replicas: pairs are drawn from it. Averaging every step (the data
        # nodes' stage 0) goes by the last heartbeat's unless it finds no partner among other replicas
        # (one that was joining then may be active now): a DHT read per step made a lone data node's
        # steps 0.1 s longer
        if self.config.inner_steps > 1 or (self._others() and self._partner(epoch) is None):
            try:
                await self.ctx.refresh_view()
            except Exception as e:
                logger.info("[%s] epoch %d: could not refresh the view (%r)", self.ctx.short_id, epoch, e)
        if not self._others():  # the stage's only replica: nobody to average with, nothing to encode
            await self._apply(epoch, self._owed(full), None)
            return
        offer = await worker.compute(self._encode, full, priority=BACKWARD)
        delta = offer.delta  # Δ as the partner decodes it: what both of us average
        loop = asyncio.get_running_loop()
        self._answered = loop.create_future()
        self._offer = loop.create_future()
        self._offer.set_result(offer)
        self._offer_epoch = epoch
        partner = self._partner(epoch)
        theirs = None
        started = time.monotonic()
        try:
            # The lower id calls at once; the higher waits a while, then calls (our views of the stage
            # may differ); the odd one out waits briefly for whoever asks.
            if partner is None:
                # the odd one out, or our views differ: someone may still ask. Not when averaging every
                # step (data nodes' stage 0): a missed pair costs one step's drift, a wait every step
                if self._others() and self.config.inner_steps > 1:
                    theirs = await self._wait_for_call(min(ODD_ONE_OUT_WAIT_S, self.timeout_s / 3))
            elif self.ctx.peer_id < partner:
                theirs = await self._call(partner, epoch, offer)
                theirs = theirs or await self._wait_for_call(self.timeout_s / 3)
            else:
                theirs = await self._wait_for_call(self.timeout_s / 3)
                theirs = theirs or await self._call(partner, epoch, offer)
        except Exception as e:  # an unreachable partner, a broken stream, bad tensors: a local step
            logger.info("[%s] epoch %d: exchange failed (%r)", self.ctx.short_id, epoch, e)
        finally:
            self._offer_epoch = -1  # late requests for this epoch are refused from here on
        if theirs is None and self._answered.done():
            theirs = self._answered.result()
        if theirs is None:
            logger.info("[%s] epoch %d: no partner in time; local outer step", self.ctx.short_id, epoch)
            delta = self._owed(full)
        else:
            self.exchange_s.append(time.monotonic() - started)
            self.error = offer.error
        await self._apply(epoch, delta, theirs)

    def _owed(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """A local step's Δ: nothing was sent, so the step takes all that is owed, exactly."""
        if self.error is not None:
            full = [d + e for d, e in zip(full, self.error, strict=True)]
        self.error = None
        return full

    def _encode(self, delta: list[torch.Tensor]) -> Offer:
        phi = list(self.state.phi)
        pieces, sent, error = self.codec.encode_delta(delta, self.error)
        phi_out, delta_out = self.worker.hooks.outer(phi, sent)  # an experiment's hostile replica
        if delta_out is not sent:  # its attack changed them: send those
            pieces = self.codec.encode_delta(delta_out, None)[0]
        return Offer(phi, sent, self.codec.encode_phi(phi_out), pieces, error, phi_digest(phi_out))

    async def _wait_for_call(self, timeout_s: float):
        """A partner's tensors if one calls us within `timeout_s` (our views of the stage may differ:
        whoever sees a partner asks, and the other side answers whoever asks first)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._answered), timeout_s)
        except TimeoutError:
            return None

    def _others(self) -> list[str]:
        view = self.ctx.view
        stage = self.worker.stage
        return [n.peer_id for n in (view.replicas(stage) if view else ()) if n.peer_id != self.ctx.peer_id]

    def _partner(self, epoch: int) -> str | None:
        view = self.ctx.view
        if view is None:
            return None
        replicas = [n.peer_id for n in view.replicas(self.worker.stage) if n.state == "active"]
        if self.ctx.peer_id not in replicas:
            replicas.append(self.ctx.peer_id)
        return noloco_partner(self.ctx.run.run_id, self.worker.stage, epoch, replicas, self.ctx.peer_id)

    async def _apply(self, epoch: int, delta: list[torch.Tensor], theirs) -> None:
        before = self.state
        theirs, verdict = self._screened(epoch, delta, theirs)
        if theirs is None:
            self.state = local_step(before, delta, self.config)
            self.local_steps += 1
        else:
            their_phi, their_delta = theirs
            self.state = noloco_step(before, delta, [their_phi], [their_delta], self.config)
            mine = [p + d for p, d in zip(before.phi, delta, strict=True)]
            their_theta = [p + d for p, d in zip(their_phi, their_delta, strict=True)]
            self.distances.append((self.worker.optimizer.step_count, replica_distance(mine, their_theta)))
            self.pair_steps += 1
        gap = self.distances[-1][1] if theirs is not None else None  # ‖θ_partner − θ‖ of what we took
        moved = distance(self.state.phi, before.phi)
        if self.robust:
            self.history = remember(self.history, norm(delta), verdict, self.window, moved)
        self.outer_log.append(OuterStep(epoch, self._taken_from, theirs is not None, norm(delta), moved, gap))
        await self.worker.compute(load_slow_weights, self.worker.module, self.state, priority=BACKWARD)
        self.epoch = epoch

    # ---- the exchange, both sides ------------------------------------------------------------------

    async def _call(self, partner: str, epoch: int, offer: Offer) -> tuple[list, list] | None:
        try:
            stream = await self.ctx.rpc.gossip.open(partner, self.timeout_s)
        except Exception as e:
            self.ctx.suspects.mark(partner, f"gossip dial failed: {e!r}")
            raise
        try:
            request = GossipRequest(
                stage=self.worker.stage, epoch=epoch, tensors=len(offer.phi), phi_digest=offer.phi_digest
            )
            await stream.write_message(request)
            reply = await read_reply(stream, (GossipAccept, Ack))
            if isinstance(reply, Ack):
                self.refused += 1
                logger.info("[%s] epoch %d: %s declined: %s", self.ctx.short_id, epoch, partner[-8:],
                            printable(reply.reason, 160))  # fmt: skip
                return None
            same_phi = reply.phi_digest == offer.phi_digest
            await self._send(stream, offer, same_phi)
            return (*await self._receive(stream, same_phi), partner)
        finally:
            stream.close()

    async def on_gossip(self, request: GossipRequest, stream: FramedStream, sender: str) -> Ack | None:
        """A replica asks to average with us for `request.epoch`: once our own offer for that epoch is
        ready we say yes with our φ's digest, read its tensors, then send ours."""
        reason = self._refusal(request, sender)
        if reason is None:
            offer = await self._wait_for_offer(request.epoch)
            reason = None if offer is not None else f"not at epoch {request.epoch} in time"
        if reason is not None:
            return Ack(accepted=False, reason=reason)
        self._offer_epoch = -1  # one exchange per epoch
        await stream.write_message(GossipAccept(phi_digest=offer.phi_digest))
        same_phi = request.phi_digest == offer.phi_digest
        theirs = await self._receive(stream, same_phi)
        await self._send(stream, offer, same_phi)
        if self._answered is not None and not self._answered.done():
            self._answered.set_result((*theirs, sender))
        return None

    def _refusal(self, request: GossipRequest, sender: str) -> str | None:
        if request.stage != self.worker.stage:
            return f"this node holds stage {self.worker.stage}, not {request.stage}"
        if request.tensors != len(self.state.phi):
            return f"expected {len(self.state.phi)} tensors, got {request.tensors}"
        view = self.ctx.view
        if view is None or sender not in {n.peer_id for n in view.replicas(self.worker.stage)}:
            return "not a live replica of this stage"
        if request.epoch <= self.epoch:
            return f"epoch {request.epoch} is over here"
        return None

    async def _wait_for_offer(self, epoch: int):
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self._offer_epoch == epoch and self._offer is not None and self._offer.done():
                return self._offer.result()
            if self.epoch >= epoch:
                return None
            await asyncio.sleep(0.02)
        return None

    async def _send(self, stream: FramedStream, offer: Offer, same_phi: bool) -> None:
        pieces = offer.delta_pieces if same_phi else offer.phi_pieces + offer.delta_pieces
        for piece in pieces:
            self.bytes_sent += await stream.write_exact(piece, _wire_dtype(piece))
        if same_phi:
            self.phi_skipped += 1

    async def _receive(self, stream: FramedStream, same_phi: bool) -> tuple[list, list]:
        """The partner's φ and Δ as decoded; its φ is ours where the digests said they are the same."""
        shapes = [tuple(p.shape) for p in self.state.phi]
        device = self.state.phi[0].device if self.state.phi else None
        phi_specs = [] if same_phi else self.codec.phi_specs(shapes)
        pieces = []
        for want in phi_specs + self.codec.delta_specs(shapes):
            spec = TensorSpec(want.dtype, want.shape, want.max_abs)
            pieces.append(await stream.read_exact(spec, max_bytes=max(1, want.nbytes), device=device))
        half = len(phi_specs)
        try:
            phi = list(self.state.phi) if same_phi else self.codec.decode_phi(pieces[:half], shapes)
            delta = self.codec.decode_delta(pieces[half:], shapes)
            check_partner_tensors(phi, self.state.phi, "partner phi", dtype=torch.float32)
            check_partner_tensors(delta, self.state.phi, "partner delta", dtype=torch.float32)
        except BadTensor:
            self.refused += 1
            raise
        return phi, delta

    def stats(self) -> dict:
        return {
            "mode": "noloco",
            "outer_epoch": self.epoch,
            "pair_steps": self.pair_steps,
            "local_steps": self.local_steps,
            "refused": self.refused,
            "replica_distance": [[step, round(d, 6)] for step, d in self.distances],
            "exchange_s": [round(t, 4) for t in self.exchange_s],
            "codec": self.codec.name,
            "bytes_per_exchange": self.codec.bytes_per_exchange([tuple(p.shape) for p in self.state.phi]),  # one way
            "phi_bytes_per_exchange": sum(
                s.nbytes for s in self.codec.phi_specs([tuple(p.shape) for p in self.state.phi])
            ),
            "bytes_sent": self.bytes_sent,
            "phi_skipped": self.phi_skipped,  # exchanges whose φ did not travel: the partner's was the same
            "phi_checksum": float(sum(float(float64(p).sum()) for p in self.state.phi)),
            "screened_out": self.screened_out,
            "outer_log": [step.as_list() for step in self.outer_log],
            "refusals": self.excluded,
        }

    # ---- the robust outer step (docs/security.md) -----------------------------------------------------

    def _screened(
        self, epoch: int, delta: list[torch.Tensor], theirs
    ) -> tuple[tuple[list, list] | None, PartnerVerdict | None]:
        """A partner's (φ, Δ) if the robust outer step takes it, else None (a local step); and the
        verdict (None: no partner, or no screening), for our history of the stage's outer steps."""
        verdict, self._taken_from = None, None
        if theirs is not None:
            their_phi, their_delta, partner = theirs
            theirs, self._taken_from = (their_phi, their_delta), partner
            if self.robust:
                limits = (self.history, self.tolerance, self._step_bound(epoch))
                verdict = screen_partner(self.state.phi, delta, their_phi, their_delta, *limits)
                shunned = self._refused_by_the_stage().get(partner)
                if shunned is not None and verdict.accepted:
                    verdict = dataclasses.replace(verdict, accepted=False, reason=shunned)
                if not verdict.accepted:
                    self.screened_out += 1
                    self.refusals.pop(partner, None)
                    self.refusals[partner] = printable(f"robust outer step, epoch {epoch}: {verdict.reason}", 200)
                    while len(self.refusals) > MAX_REFUSALS_LISTED:
                        del self.refusals[next(iter(self.refusals))]
                    logger.warning("[%s] epoch %d: refused %s as partner: %s", self.ctx.short_id, epoch,
                                   partner[-8:], verdict.reason)  # fmt: skip
                    self.worker.spawn(self.ctx.publish(), "publish a refusal")  # data nodes act on it: say it now
                    theirs = None
        return theirs, verdict

    def _refused_by_the_stage(self) -> dict[str, str]:
        """Replicas of our stage that at least two others, a majority of them, refused as partners
        (the rule data nodes exclude by, shoal.train.audit.refused_by_partners): their slow weights are
        not taken even when they look within our own limits. A backdoor replica's slow weights keep
        its direction after data nodes stop routing to it and its Δ shrinks to nothing; honest replicas
        that had not met it yet took them."""
        view = self.ctx.view
        if view is None:
            return {}
        stage = self.worker.stage
        replicas = [n for n in view.live_nodes() if n.stage == stage and n.stage > 0]
        stage_of = {n.peer_id: stage for n in replicas} | {self.ctx.peer_id: stage}
        refusals = {n.peer_id: {peer for peer, _ in n.excluded} for n in replicas if n.peer_id != self.ctx.peer_id}
        refusals[self.ctx.peer_id] = set(self.refusals)
        return refused_by_partners(refusals, stage_of)

    def _step_bound(self, epoch: int) -> float:
        """M for this epoch's H inner steps (robust.epoch_step_bound), at the run's learning rates. Under
        top-k a sent Δ carries what earlier epochs' left out (error feedback), so its bound is every
        epoch's so far: ‖topk(Δ_t + e)‖ ≤ ‖Δ_1 + … + Δ_t‖ (a weaker screen; docs/security.md)."""
        run, parameters = self.ctx.run, sum(p.numel() for p in self.state.phi)
        epochs = range(1, epoch + 1) if self.codec.name == "topk" else (epoch,)
        return sum(epoch_step_bound(run.optim, run.train.steps, self.config.inner_steps, e, parameters) for e in epochs)

    @property
    def excluded(self) -> list[dict]:
        """The partners we refused, latest last, as node-record entries."""
        return [{"peer_id": peer, "reason": reason} for peer, reason in self.refusals.items()]
