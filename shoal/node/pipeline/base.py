"""The pipeline engine both a data node and a stage worker are: its compute thread (torch work off the
event loop, so heartbeats and RPCs stay responsive while a stage computes), its wire format, sending a
hop and re-routing or redoing a lost one (hops.py says what a hop is), the bans on peers that failed
it, and the averager of the stage it holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shoal.device import compute_context
from shoal.logs import printable
from shoal.node.averaging.base import Averager
from shoal.node.averaging.noloco import NoLoCoAverager
from shoal.node.compute import BACKGROUND, BACKWARD, ComputeThread
from shoal.node.engine import TrainedState, snapshot_trained
from shoal.node.pipeline.hops import WIRE_MAX_ABS, HopFailed
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import BoundRpc, Rpc, StreamPool
from shoal.p2p.streams import FramedStream, RemoteError, read_reply
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import (
    Ack,
    BackwardRequest,
    ForwardRequest,
    GossipRequest,
    Hop,
    OutputRequest,
    RecomputeRequest,
    RedoOutputRequest,
)
from shoal.protocol.tensors import DTYPE_SIZES, TensorSpec, wire_nbytes
from shoal.protocol.torch_tensors import pack_tokens, unpack_tokens

if TYPE_CHECKING:
    from shoal.node.context import NodeContext
    from shoal.planning.observed import Trip
    from shoal.planning.swarm_view import SwarmView

logger = logging.getLogger(__name__)

T = TypeVar("T")
FAILED_PEER_BAN_S = 15.0  # like Petals: skip a peer that just failed us, then give it another chance
SEND_RETRIES = 2  # a failed stream is retried on the same peer this many times before it counts
RETRY_BACKOFF_S = 0.25
VIEW_READ_MIN_S = 0.5  # an unknown peer makes a handler read the view afresh, at most this often
STAGE_POLL_S = 0.5


@dataclass
class Traffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    tensors_sent: int = 0
    tensors_received: int = 0


class PipelineEngine:
    """What stage workers and data nodes share: compute thread, wire format, sending, bans, and the
    averager of the stage they hold (built by each, once its module and optimizer exist)."""

    averager: Averager | None = None
    copies_serving = 0  # copies of its stage it is streaming to joiners now (stage/copy.py)

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.run = ctx.run
        self.wire_dtype = self.run.pipeline.wire_dtype
        self.device = ctx.device
        self.compute_thread = ComputeThread(
            f"compute-{ctx.short_id}",
            trace_path=ctx.config.output.compute_trace,
            job_context=lambda: compute_context(ctx.device, ctx.compute_dtype),
        )
        self.traffic = Traffic()
        self.banned_until: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self.stream_retries = 0
        self.streams = StreamPool(ctx.transport)  # kept streams for this engine's hops and step closes
        self.rpc = EngineRpcs(ctx.transport, self.streams)
        self.recomputes_delegated = 0
        self.outputs_redone = 0  # outputs of lost hops we had redone upstream (redo_output)
        self._view_read_at = 0.0
        self._view_read: asyncio.Future | None = None  # the fresh view read under way, if any (`listed`)
        m, t = self.run.model, self.run.train
        width = m.residual_dim  # a Subspace Network's coefficients, or the full stream
        self.activation_spec = TensorSpec(self.wire_dtype, (None, None, width), WIRE_MAX_ABS)
        self.max_activation_bytes = t.microbatch_size * m.max_seq_len * width * DTYPE_SIZES[self.wire_dtype]

    async def state_dict(self) -> TrainedState | None:
        """Weights, inner and outer optimizer state of the stage it holds (`module`, `optimizer`), between
        two compute jobs; None during an outer step, whose new slow weights would not match the weights yet."""
        return await self.compute(self._snapshot, priority=BACKWARD)

    def _snapshot(self) -> TrainedState | None:
        averager = self.averager
        if averager is not None and averager.stepping:
            return None
        outer = averager.state if averager is not None else None
        epoch = averager.epoch if averager is not None else 0
        return snapshot_trained(self.module, self.optimizer, outer, epoch)  # type: ignore[attr-defined]

    async def compute(self, fn: Callable[..., T], *args: Any, priority: int = BACKGROUND) -> T:
        return await self.compute_thread.run(priority, fn, *args)

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Future:
        """Run work in the background, kept so shutdown can cancel it."""
        task = asyncio.ensure_future(coro)
        if isinstance(task, asyncio.Task):
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._task_done(done, name))
        return task

    def _task_done(self, task: asyncio.Future, name: str) -> None:
        """A gather of tasks (a future, not a task) that shutdown cancelled ends with CancelledError as
        its exception rather than cancelled: that is no failure either."""
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, asyncio.CancelledError):
            logger.error("[%s] %s failed: %r", self.ctx.short_id, name, error)

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self.banned_until.items() if until > now}

    async def listed(self, peer_id: str, stages: Collection[int] | None = None) -> bool:
        """Whether our view lists `peer_id` as a live worker (of one of `stages`, if given). A peer that
        just took a stage (a replacement, a rebuilt stage) may be missing from a view a heartbeat
        old: before saying no, read the view afresh (at most every VIEW_READ_MIN_S)."""
        if self._lists(peer_id, stages):
            return True
        if self._view_read is None or self._view_read.done():
            if time.monotonic() - self._view_read_at < VIEW_READ_MIN_S:
                return False
            self._view_read_at = time.monotonic()
            self._view_read = asyncio.ensure_future(self.ctx.refresh_view())
        # Handlers that ask while a read is under way wait for it: answering "not listed" meanwhile
        # refused a replacement's recomputes that came together (seen: 2 of 3 lost after a kill).
        try:
            await asyncio.shield(self._view_read)
        except Exception as e:
            logger.info("[%s] could not read the view: %s", self.ctx.short_id, e)
            return False
        return self._lists(peer_id, stages)

    async def read_view_after(self, since: float) -> bool:
        """Make sure a view read that began at `since` (monotonic) or later is done; False if a read
        failed. A peer that sent us something before that read began and is missing from it is not
        listed. A read under way that began in time is shared; reads begin at most every
        VIEW_READ_MIN_S, and a caller waits for its turn (`listed` answers "no" meanwhile instead)."""
        while True:
            read = self._view_read
            if read is None or read.done():
                if read is not None and self._view_read_at >= since:
                    return not read.cancelled() and read.exception() is None
                delay = self._view_read_at + VIEW_READ_MIN_S - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                self._view_read_at = time.monotonic()
                read = self._view_read = asyncio.ensure_future(self.ctx.refresh_view())
            try:
                await asyncio.shield(read)
            except Exception as e:
                logger.info("[%s] could not read the view: %s", self.ctx.short_id, e)
                return False

    def _lists(self, peer_id: str, stages: Collection[int] | None) -> bool:
        view = self.ctx.view
        return view is not None and any(
            n.peer_id == peer_id and n.stage > 0 and (stages is None or n.stage in stages) for n in view.live_nodes()
        )

    def ban(self, peer_id: str, error: HopFailed | None = None) -> None:
        """Route around `peer_id` for a while; where the stream itself failed (not a peer that answered
        no), suspect it node-wide at once (net/suspects.py). A node never bans or suspects itself: a
        hop that named it twice failed on the route, not on us."""
        if peer_id == self.ctx.peer_id:
            return
        self.banned_until[peer_id] = time.monotonic() + FAILED_PEER_BAN_S
        if error is None or not error.refused:
            self.ctx.suspects.mark(peer_id, str(error) if error is not None else "reported lost by a peer")

    def check_activation(self, x: torch.Tensor) -> None:
        batch, seq = x.shape[0], x.shape[1]
        if not (1 <= batch <= self.run.train.microbatch_size and 1 <= seq <= self.run.model.max_seq_len):
            raise BadTensor(
                f"activation shape {tuple(x.shape)} outside this run's microbatch "
                f"({self.run.train.microbatch_size}, {self.run.model.max_seq_len}, d)"
            )

    def read_tokens(self, data: bytes, x: torch.Tensor) -> torch.Tensor | None:
        """The token ids a request carries beside activation `x` (a Subspace Network's run), on this
        node's device; None in any other run, where a request must carry none. Raises BadTensor."""
        m = self.run.model
        if not m.subspace_rank:
            if data:
                raise BadTensor("token ids sent in a run whose stages do not take them")
            return None
        ids = unpack_tokens(data, (x.shape[0], x.shape[1]), m.vocab_size)
        return ids if self.device.type == "cpu" else ids.to(self.device)

    def pack_tokens(self, tokens: torch.Tensor | None) -> bytes:
        """What a request carries of `tokens`: the ids in a Subspace Network's run, else nothing."""
        if not self.run.model.subspace_rank or tokens is None:
            return b""
        return pack_tokens(tokens, self.run.model.vocab_size)

    async def read_activation(self, stream: FramedStream) -> torch.Tensor:
        x = await stream.read_tensor(self.activation_spec, max_bytes=self.max_activation_bytes, device=self.device)
        self.check_activation(x)
        self.traffic.tensors_received += 1
        self.traffic.bytes_received += wire_nbytes(tuple(x.shape), self.wire_dtype)
        return x

    async def send(
        self, peer_id: str, rpc: Rpc, request: object, tensor: torch.Tensor, retries: int = SEND_RETRIES
    ) -> Ack:
        """Send one request and its tensor; returns the receiver's Ack once it took it.

        A stream that fails before the receiver answered is retried on the same peer (receivers
        treat a repeated microbatch as taken), so one broken stream between live peers costs a retry,
        never a replica. A peer that answers "no" is not retried here. A node never sends a hop to
        itself (libp2p cannot dial oneself): admission refuses a route that would make it."""
        if peer_id == self.ctx.peer_id:
            raise HopFailed(f"{rpc.name} addressed to this node itself", refused=True)
        for attempt in range(retries + 1):
            try:
                return await self._send_once(peer_id, rpc, request, tensor)
            except HopFailed as e:
                if e.refused or attempt == retries:
                    raise
                self.stream_retries += 1
                logger.info("[%s] %s to %s: %s; retrying", self.ctx.short_id, rpc.name, peer_id[-8:], e)
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _send_once(self, peer_id: str, rpc: Rpc, request: object, tensor: torch.Tensor) -> Ack:
        """One hop on a kept stream to the peer if there is one (a kept stream found dead is replaced by
        a fresh one at once: the peer takes a repeat as done), else on a new stream."""
        timeout_s = self.ctx.config.network.rpc_timeout_s
        started = time.monotonic()
        for fresh in (False, True):
            try:
                stream, kept = await self.streams.take(peer_id, rpc, timeout_s, fresh=fresh)
            except Exception as e:
                raise HopFailed(f"cannot reach {peer_id[-8:]}: {type(e).__name__}") from None
            try:
                kind = "gradient" if rpc in (EngineRpcs.backward, EngineRpcs.recompute) else "activation"
                sent = await stream.write_tensor(tensor, self.wire_dtype, leading=(request,), kind=kind)
                ack = await read_reply(stream, Ack)
                break
            except RemoteError as e:
                stream.close()
                raise HopFailed(f"{peer_id[-8:]} refused: {printable(str(e), 160)}", refused=True) from None
            except Exception as e:
                stream.close()
                if kept:
                    self.streams.found_dead += 1
                    continue
                raise HopFailed(f"{peer_id[-8:]} failed: {type(e).__name__} {e}"[:200]) from None
        if not ack.accepted:  # the peer's own words: made printable, since they may travel on
            stream.close()
            raise HopFailed(f"{peer_id[-8:]} declined: {printable(ack.reason, 160)}", refused=True)
        self.streams.give_back(peer_id, rpc, stream)
        self.traffic.tensors_sent += 1
        self.traffic.bytes_sent += sent
        self.ctx.links.observe_send(peer_id, sent, time.monotonic() - started)
        return ack

    async def fetch_output(self, peer_id: str, microbatch_id: str, hop: int) -> torch.Tensor:
        """What `peer_id` sent to hop `hop + 1` of a microbatch (it keeps that until backward passes)."""
        return await self._ask_for_tensor(
            peer_id, self.rpc.fetch_output, OutputRequest(microbatch_id=microbatch_id, hop=hop)
        )

    async def redo_output(
        self, request: RecomputeRequest | RedoOutputRequest, hop: int, failed: str, why: str
    ) -> torch.Tensor:
        """What hop `hop` of this microbatch sent on, computed again by a live replica of its stage: its
        holder `failed` is gone with it. That replica gets its own input the same way, walking upstream
        as far as it must. Raises HopFailed if no replica of the stage is left or none could."""

        async def ask(peer: str, route: tuple[Hop, ...]) -> torch.Tensor:
            redo = RedoOutputRequest(microbatch_id=request.microbatch_id, origin=request.origin,
                                     step=request.step, hop=hop, route=route, tokens=request.tokens)  # fmt: skip
            output = await self._ask_for_tensor(peer, self.rpc.redo_output, redo)
            self.outputs_redone += 1
            logger.info("[%s] %s: the output of hop %d (stage %d) redone by %s after: %s", self.ctx.short_id,
                        request.microbatch_id, hop, route[hop].stage, peer[-8:], why[:80])  # fmt: skip
            return output

        return await self._on_a_stand_in(request, hop, failed, why, ask, ban_refusals=False)  # "its input is lost too"

    async def _on_a_stand_in(
        self,
        request: BackwardRequest | RecomputeRequest | RedoOutputRequest,
        hop: int,
        failed: str,
        why: str,
        attempt: Callable[[str, tuple[Hop, ...]], Awaitable[T]],
        ban_refusals: bool = True,
    ) -> T:
        """`attempt(peer, route)` on live replicas of hop `hop`'s stage other than `failed` (`route`
        names the replica at `hop`), one after another until one does it; a replica that failed is not
        tried again, and is banned (one that answered no, only if `ban_refusals`). Raises HopFailed
        (stage lost) once no replica is left."""
        stage = request.route[hop].stage
        prev = request.origin if hop == 0 else request.route[hop - 1].peer_id
        tried = {failed}
        while True:
            peer = await self.wait_for_replacement(stage, tried, prev, self.ctx.peer_id)
            if peer is None:
                raise HopFailed(f"stage_lost: no live replica of stage {stage} ({why})"[:200], stage_lost=True)
            route = list(request.route)
            route[hop] = Hop(stage=stage, peer_id=peer)
            try:
                return await attempt(peer, tuple(route))
            except HopFailed as e:
                if ban_refusals or not e.refused:
                    self.ban(peer, e)
                tried.add(peer)
                why = str(e)

    async def _ask_for_tensor(self, peer_id: str, rpc: BoundRpc, request: object) -> torch.Tensor:
        """Send `request` and read back an Ack, then (if accepted) an activation."""
        timeout_s = self.ctx.config.network.rpc_timeout_s
        if peer_id == self.ctx.peer_id:
            raise HopFailed("an output asked of this node itself", refused=True)
        try:
            stream = await rpc.open(peer_id, timeout_s)
        except Exception as e:
            raise HopFailed(f"cannot reach {peer_id[-8:]}: {type(e).__name__}") from None
        try:
            await stream.write_message(request)
            ack = await read_reply(stream, Ack)
            if not ack.accepted:
                raise HopFailed(f"{peer_id[-8:]} has no output for it: {printable(ack.reason, 160)}", refused=True)
            return await self.read_activation(stream)
        except RemoteError as e:
            raise HopFailed(f"{peer_id[-8:]} refused: {e}", refused=True) from None
        except HopFailed:
            raise
        except Exception as e:
            raise HopFailed(f"{peer_id[-8:]} failed: {type(e).__name__} {e}"[:200]) from None
        finally:
            stream.close()

    async def serve_output(self, tensor: torch.Tensor | None, reason: str, stream: FramedStream) -> None:
        """Answer an OutputRequest: an Ack, then the tensor if we have it."""
        if tensor is None:
            await stream.write_message(Ack(accepted=False, reason=reason))
            return
        self.traffic.bytes_sent += await stream.write_tensor(tensor, self.wire_dtype, leading=(Ack(accepted=True),))
        self.traffic.tensors_sent += 1

    def replacement(self, stage: int, exclude: set[str], prev: str, nxt: str) -> str | None:
        """Another live replica of `stage` to take over a hop between `prev` and `nxt`, by the node's
        routing policy (GWTF: the cheapest d(prev, j) + d(j, nxt)), or None if the view has none."""
        return self.ctx.router.replace(stage, prev, nxt, self.banned() | exclude)

    async def wait_for_replacement(self, stage: int, exclude: set[str], prev: str, nxt: str) -> str | None:
        """A live replica of `stage` outside `exclude`, waiting (bounded by the node's stage wait) while
        the view has none: a stage briefly without a replica is waited for, not given up on. Peers
        excluded or banned are tried again once nothing else is left."""

        def replacement_now(view: SwarmView) -> str | None:
            nonlocal exclude
            peer = self.replacement(stage, exclude, prev, nxt)
            if peer is None:  # the next look may try again those still listed
                exclude = {p for p in exclude if self._still_listed(p, stage) is False}
            return peer

        return await self.ctx.wait_for(replacement_now, self.ctx.config.limits.stage_wait_s, poll_s=STAGE_POLL_S)

    def _still_listed(self, peer_id: str, stage: int) -> bool:
        view = self.ctx.view
        return view is not None and any(n.peer_id == peer_id for n in view.replicas(stage))

    async def delegate_recompute(
        self,
        request: BackwardRequest | RecomputeRequest,
        hop: int,
        grad: torch.Tensor,
        failed: str,
        why: str,
        tokens: bytes = b"",
    ) -> tuple[Hop, ...]:
        """Hop `hop` of this microbatch is gone with its graph (its peer `failed` did not take our
        gradient): have another replica of its stage redo only that hop, from the input the hop
        before it kept and the gradient we hold; returns the route as the stand-in took it. Raises
        HopFailed if no replica of the stage is left."""

        async def recompute(peer: str, route: tuple[Hop, ...]) -> tuple[Hop, ...]:
            redo = RecomputeRequest(microbatch_id=request.microbatch_id, origin=request.origin, step=request.step,
                                    hop=hop, route=route, tokens=tokens)  # fmt: skip
            await self.send(peer, EngineRpcs.recompute, redo, grad)
            self.recomputes_delegated += 1
            logger.info("[%s] %s: hop %d (stage %d) redone by %s after: %s", self.ctx.short_id,
                        request.microbatch_id, hop, route[hop].stage, peer[-8:], why[:80])  # fmt: skip
            return route

        return await self._on_a_stand_in(request, hop, failed, why, recompute)

    # ---- what every pipeline engine answers the node (engine.py) --------------------------------------

    def traffic_counts(self) -> dict[str, int]:
        return asdict(self.traffic)

    def trips(self) -> Sequence[Trip]:
        return ()

    def on_view(self, view: SwarmView) -> None:
        """A fresh view of the swarm (each heartbeat)."""

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """Lift our bans on peers that came back: the ban was earned by their old process."""
        for peer in restarted:
            self.banned_until.pop(peer, None)

    async def on_gossip(self, request: GossipRequest, stream: FramedStream, sender: str) -> Ack | None:
        if not isinstance(self.averager, NoLoCoAverager):
            return Ack(accepted=False, reason="this run does not average with NoLoCo")
        return await self.averager.on_gossip(request, stream, sender)

    async def stop(self) -> None:
        if self.averager is not None:
            await self.averager.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.streams.close()
        self.compute_thread.shutdown()


async def push_forward(engine: PipelineEngine, request: ForwardRequest, tensor: torch.Tensor) -> ForwardRequest:
    """Deliver an activation to hop `request.hop`, re-routing that hop to another live replica of
    the same stage if its peer fails (the sender still holds the tensor, so only this hop is redone).
    While the stage has no other replica it waits for one (bounded by the node's stage wait).
    Returns the request as delivered (its route may have changed); raises HopFailed if nobody took it.
    """
    failures: list[str] = []
    tried: set[str] = set()
    stage_lost = False
    while True:
        home = request.hop == len(request.route)
        target = request.origin if home else request.route[request.hop].peer_id
        try:
            started = time.monotonic()
            ack = await engine.send(target, EngineRpcs.forward, request, tensor)
            if not home:
                router = engine.ctx.router
                router.observe(engine.ctx.peer_id, target, request.route[request.hop].stage, time.monotonic() - started)
                if ack.load is not None and ack.onward_s is not None:
                    router.heard(engine.ctx.peer_id, target, ack.load, ack.onward_s, request.origin)
            return request
        except HopFailed as e:
            failures.append(str(e))
            engine.ban(target, e)
            tried.add(target)
            if home:
                break
            stage = request.route[request.hop].stage
            nxt = request.origin if request.hop + 1 == len(request.route) else request.route[request.hop + 1].peer_id
            replica = await engine.wait_for_replacement(stage, tried, engine.ctx.peer_id, nxt)
            if replica is None:
                failures.append(f"stage_lost: no live replica of stage {stage}")
                stage_lost = True
                break
            route = list(request.route)
            route[request.hop] = Hop(stage=stage, peer_id=replica)
            logger.info(
                "[%s] re-routing %s: stage %d -> %s", engine.ctx.short_id, request.microbatch_id, stage, replica[-8:]
            )
            request = ForwardRequest(  # without planned starts: a re-routed path is not the one planned
                microbatch_id=request.microbatch_id,
                origin=request.origin,
                step=request.step,
                hop=request.hop,
                route=tuple(route),
                needs_backward=request.needs_backward,
                tokens=request.tokens,
            )
    raise HopFailed("; ".join(failures[-3:])[:200], stage_lost=stage_lost)
