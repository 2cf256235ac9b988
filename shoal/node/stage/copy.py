"""Join by copy: a node taking a stage that has a live replica copies that replica's weights (θ), its
slow weights (φ) and its step counters over one stream before it announces itself active, so it
serves the swarm's model from its first microbatch instead of a fresh one (papers/noloco.md;
DESIGN §5, "Join"). What arrives is checked like anything from a peer: count, shapes, dtype, finite.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shoal.config import RunConfig
from shoal.node.averaging.base import Averager, epoch_steps
from shoal.node.compute import BACKWARD
from shoal.node.context import NodeContext
from shoal.node.engine import GradNorms
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import FramedStream, read_reply
from shoal.p2p.transport import Transport
from shoal.planning.donors import donor_order
from shoal.planning.time_limits import wait_limit_s
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import Ack, StageCopy, StageCopyRequest
from shoal.protocol.tensors import TensorSpec
from shoal.train.inner import OptimizerState, load_optimizer_state, optimizer_state
from shoal.train.outer import check_partner_tensors, counters_refusal

logger = logging.getLogger(__name__)

WIRE_DTYPE = "float32"
COPIES_AT_ONCE = 1  # a replica streams one copy of its stage at a time: a second joiner is sent to another
BUSY = "busy: serving another copy of this stage"
BUSY_RETRY_S = 0.5
BUSY_WAIT_S = 120.0  # how long a joiner whose every donor is busy keeps asking, at least (busy_wait_s)
FAILED_WAIT_S = 3.0  # after every listed donor failed: how long other replicas may appear to copy from


class DonorBusy(Exception):
    """The replica asked is streaming its stage to someone else: ask another, or again shortly."""


class BadCounters(Exception):
    """A copy's inner step or outer epoch is one no replica of our run stands at: not taken."""


class StageHolder(Protocol):
    """A stage worker (or a data node, for stage 0), as copying and repairing a stage see it."""

    ctx: NodeContext
    stage: int
    module: torch.nn.Module
    optimizer: Any  # shoal.train.inner.InnerOptimizer
    averager: Averager | None
    grad_norms: GradNorms
    copies_serving: int  # copies of its stage it is streaming now

    async def compute(self, fn: Callable[..., Any], *args: Any, priority: int = ...) -> Any: ...


def wants_moments(worker: StageHolder) -> bool:
    """Whether a joiner of this stage copies AdamW's moments too: data nodes that average stage 0's
    gradients step in lockstep, and one with fresh moments would step differently on the same mean."""
    return worker.stage == 0 and worker.ctx.run.averaging.stage0 == "gradients"


Snapshot = tuple[list[torch.Tensor], list[torch.Tensor], OptimizerState | None]  # θ, φ, AdamW's state


def _snapshot(worker: StageHolder, moments: bool) -> Snapshot:
    theta = [p.detach().clone() for p in worker.module.parameters()]
    phi = list(worker.averager.state.phi) if worker.averager is not None else theta
    return theta, phi, optimizer_state(worker.optimizer) if moments else None


async def serve_stage_copy(worker: StageHolder, request: StageCopyRequest, stream: FramedStream) -> None:
    """Answer a joining replica (or a node rebuilding a neighbouring stage): an Ack, our counters and
    last gradient norms, then θ and φ, taken between compute jobs."""
    if request.stage != worker.stage:
        await stream.write_message(Ack(accepted=False, reason=f"this node holds stage {worker.stage}"))
        return
    if worker.copies_serving >= COPIES_AT_ONCE:
        await stream.write_message(Ack(accepted=False, reason=BUSY))
        return
    worker.copies_serving += 1
    try:
        await _serve(worker, stream, request.moments)
    finally:
        worker.copies_serving -= 1


async def _serve(worker: StageHolder, stream: FramedStream, moments: bool) -> None:
    theta, phi, state = await worker.compute(_snapshot, worker, moments, priority=BACKWARD)
    if worker.ctx.hooks.faults.copy_delay_s:  # an experiment's slow uplink: the copy holds its slot longer
        await asyncio.sleep(worker.ctx.hooks.faults.copy_delay_s)
    epoch = worker.averager.epoch if worker.averager is not None else 0
    await stream.write_message(Ack(accepted=True))
    header = StageCopy(
        inner_step=worker.optimizer.step_count,
        outer_epoch=epoch,
        tensors=len(theta),
        grad_norm=worker.grad_norms.raw,
        grad_norm_clipped=worker.grad_norms.clipped,
        adam_steps=state.adam_steps if state is not None else (),
    )
    await stream.write_message(header)
    extra = (*state.exp_avg, *state.exp_avg_sq) if state is not None else ()
    for tensor in (*theta, *phi, *extra):
        await stream.write_tensor(tensor, WIRE_DTYPE, kind="copy")


@dataclass(frozen=True)
class FetchedStage:
    """A replica's stage as it gave it: checked tensors, its counters and its last gradient norms."""

    peer_id: str
    stage: int
    theta: list[torch.Tensor]
    phi: list[torch.Tensor]
    inner_step: int
    outer_epoch: int
    grad_norm: float | None
    grad_norm_clipped: float | None
    moments: OptimizerState | None = None  # AdamW's, where asked for and the replica had them


async def fetch_stage(
    transport: Transport,
    peer: str,
    stage: int,
    reference: list[torch.Tensor],
    timeout_s: float,
    wait_if_busy: bool = True,
    moments: bool = False,
    run: RunConfig | None = None,
) -> FetchedStage:
    """θ and φ of `stage` from `peer` (and AdamW's moments, if `moments`), checked against `reference`
    (count, shapes, dtype, finite). `p2p`: a node's, or any client's (`shoal export` fetches every stage
    this way). A peer busy serving another copy is asked again until `timeout_s` has passed, or
    (`wait_if_busy` False) raises DonorBusy. A node that takes the copy's counters passes its `run`:
    counters no replica of it stands at raise BadCounters (`counters_refusal`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await _fetch_once(transport, peer, stage, reference, timeout_s, moments, run)
        except DonorBusy:
            if not wait_if_busy or time.monotonic() + BUSY_RETRY_S >= deadline:
                raise
            await asyncio.sleep(BUSY_RETRY_S)


async def _fetch_once(
    transport: Transport,
    peer: str,
    stage: int,
    reference: list[torch.Tensor],
    timeout_s: float,
    moments: bool,
    run: RunConfig | None,
) -> FetchedStage:
    stream = await EngineRpcs(transport).copy_stage.open(peer, timeout_s)
    n = len(reference)
    try:
        await stream.write_message(StageCopyRequest(stage=stage, moments=moments))
        ack = await read_reply(stream, Ack)
        if not ack.accepted:
            raise DonorBusy(ack.reason) if ack.reason == BUSY else RuntimeError(ack.reason)
        header = await read_reply(stream, StageCopy)
        if run is not None:
            why = counters_refusal(header.inner_step, header.outer_epoch, run.train.steps,
                                   epoch_steps(run.averaging, stage))  # fmt: skip
            if why is not None:
                raise BadCounters(f"stage copy at {why}")
        if header.tensors != n:
            raise BadTensor(f"stage copy of {header.tensors} tensors, expected {n}")
        if len(header.adam_steps) not in ((0, n) if moments else (0,)):
            raise BadTensor(f"stage copy with {len(header.adam_steps)} AdamW steps for {n} tensors")
        received = []
        for like in reference * (4 if header.adam_steps else 2):
            spec = TensorSpec(WIRE_DTYPE, tuple(like.shape))
            received.append(await stream.read_tensor(spec, max_bytes=like.numel() * 4, device=like.device))
    finally:
        stream.close()
    theta, phi = received[:n], received[n : 2 * n]
    check_partner_tensors(theta, reference, "copied weights", dtype=torch.float32)
    check_partner_tensors(phi, reference, "copied slow weights", dtype=torch.float32)
    state = None
    if header.adam_steps:
        exp_avg, exp_avg_sq = received[2 * n : 3 * n], received[3 * n :]
        check_partner_tensors(exp_avg, reference, "copied first moments", dtype=torch.float32)
        check_partner_tensors(exp_avg_sq, reference, "copied second moments", dtype=torch.float32)
        if any(bool((v < 0).any()) for v in exp_avg_sq):
            raise BadTensor("copied second moments: negative values")
        state = OptimizerState(header.inner_step, tuple(header.adam_steps), tuple(exp_avg), tuple(exp_avg_sq))
    return FetchedStage(peer, stage, theta, phi, header.inner_step, header.outer_epoch, header.grad_norm,
                        header.grad_norm_clipped, state)  # fmt: skip


@dataclass
class CopyAttempt:
    """What copying our stage came to: whom we copied, and each listed donor that did not give it."""

    source: str | None = None
    failed: dict[str, str] = field(default_factory=dict)  # peer id -> why
    busy: set[str] = field(default_factory=set)  # donors that were serving someone else at the last try


async def copy_stage(worker: StageHolder, attempt: CopyAttempt | None = None) -> CopyAttempt:
    """Copy the most trained active replica of our stage that answers, skipping the donors `attempt`
    already saw fail. A record outlives its peer by up to its TTL, so a listed replica may be dead:
    each that fails is noted, for the caller to wait for others or to treat the stage as lost."""
    ctx = worker.ctx
    attempt = attempt or CopyAttempt()
    attempt.busy = set()
    view = ctx.view
    if view is None:
        return attempt
    replicas = [n for n in view.replicas(worker.stage) if n.peer_id != ctx.peer_id]
    sources = [n for n in replicas if n.state == "active" and n.peer_id not in attempt.failed]
    joiners = [n for n in replicas if n.state == "joining"]
    by_id = {n.peer_id: n for n in sources}
    ours = [p.detach() for p in worker.module.parameters()]
    for source in (by_id[p] for p in donor_order(ctx.peer_id, ctx.started_at, sources, joiners)):
        logger.info("[%s] copying stage %d from %s", ctx.short_id, worker.stage, source.peer_id[-8:])
        try:
            fetched = await fetch_stage(ctx.transport, source.peer_id, worker.stage, ours,
                                        ctx.config.network.rpc_timeout_s, wait_if_busy=False,
                                        moments=wants_moments(worker), run=ctx.run)  # fmt: skip
        except DonorBusy:
            logger.info("[%s] %s is serving another copy of stage %d: trying another replica", ctx.short_id,
                        source.peer_id[-8:], worker.stage)  # fmt: skip
            attempt.busy.add(source.peer_id)
            continue
        except Exception as e:
            logger.warning("[%s] could not copy stage %d from %s: %s", ctx.short_id, worker.stage,
                           source.peer_id[-8:], e)  # fmt: skip
            attempt.failed[source.peer_id] = str(e)[:200] or type(e).__name__
            ctx.suspects.mark(source.peer_id, f"stage copy failed: {e}")
            continue
        await adopt_stage(worker, fetched.theta, fetched.phi, fetched.inner_step, fetched.outer_epoch, fetched.moments)
        logger.info("[%s] copied stage %d from %s (inner step %d, outer epoch %d%s)", ctx.short_id, worker.stage,
                    source.peer_id[-8:], fetched.inner_step, fetched.outer_epoch,
                    ", AdamW's moments" if fetched.moments is not None else "")  # fmt: skip
        attempt.source = source.peer_id
        return attempt
    return attempt


def busy_wait_s(module: torch.nn.Module) -> float:
    """How long a joiner asks busy donors again: BUSY_WAIT_S, or longer where one copy of this stage (θ, φ
    and AdamW's moments, float32) takes longer at the planned link speed (planning/time_limits.py): a
    donor streams one copy at a time, so a joiner may wait out a whole other copy."""
    return wait_limit_s(BUSY_WAIT_S, 4 * 4 * sum(p.numel() for p in module.parameters()))


async def join_stage(worker: StageHolder) -> CopyAttempt:
    """Copy the stage for a joiner: every listed donor in turn; while all that answered were busy serving
    others, ask again (up to `busy_wait_s`); after every one failed, wait FAILED_WAIT_S for others to
    appear. Bounded in time: a joiner that got no copy says so, and its caller repairs or starts fresh."""
    attempt = await copy_stage(worker)
    started, busy_limit_s = time.monotonic(), busy_wait_s(worker.module)
    while attempt.source is None:
        waited = time.monotonic() - started
        if not ((attempt.busy and waited < busy_limit_s) or (attempt.failed and waited < FAILED_WAIT_S)):
            break
        await asyncio.sleep(BUSY_RETRY_S)
        try:
            await worker.ctx.refresh_view()
        except Exception as e:
            logger.info("[%s] could not read the view: %s", worker.ctx.short_id, e)
        attempt = await copy_stage(worker, attempt)
    if attempt.source is None and (attempt.busy or attempt.failed):
        logger.warning("[%s] no replica gave stage %d in %.0f s (busy: %d, failed: %d)", worker.ctx.short_id,
                       worker.stage, time.monotonic() - started, len(attempt.busy), len(attempt.failed))  # fmt: skip
    return attempt


async def adopt_stage(
    worker: StageHolder,
    theta: list[torch.Tensor],
    phi: list[torch.Tensor],
    inner_step: int,
    outer_epoch: int,
    moments: OptimizerState | None = None,
) -> None:
    """Serve these weights from now on, with the swarm's counters (the schedule goes on from there), and
    AdamW's moments where given (else ours, fresh)."""
    await worker.compute(_load, worker, theta, inner_step, moments, priority=BACKWARD)
    if worker.averager is not None:
        worker.averager.adopt(phi, outer_epoch)


def _load(worker: StageHolder, theta: list[torch.Tensor], inner_step: int, moments: OptimizerState | None) -> None:
    with torch.no_grad():
        for param, value in zip(worker.module.parameters(), theta, strict=True):
            param.copy_(value)
    if moments is not None:
        load_optimizer_state(worker.optimizer, moments)
    worker.optimizer.step_count = inner_step  # the learning-rate schedule goes on from there
