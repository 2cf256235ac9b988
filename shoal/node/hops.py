"""Moving a microbatch between hops: send a header and a tensor, get an Ack; remember who failed.

Shared by stage workers and data nodes. Torch work runs on one compute thread per node, off the
event loop, so heartbeats and RPCs stay responsive while a stage computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shoal.node.compute import BACKGROUND, ComputeThread
from shoal.node.transport import FramedStream, RemoteError, open_call, read_reply
from shoal.planning.routing import pick_replica
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import Ack, BackwardRequest, ForwardRequest, Hop
from shoal.protocol.tensors import DTYPE_SIZES, TensorSpec

if TYPE_CHECKING:
    from shoal.node.daemon import Node

logger = logging.getLogger(__name__)

T = TypeVar("T")
FAILED_PEER_BAN_S = 15.0  # like Petals: skip a peer that just failed us, then give it another chance


class HopFailed(Exception):
    """The receiver did not take the work: unreachable, timed out, refused, or answered an error."""


@dataclass
class Traffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    tensors_sent: int = 0
    tensors_received: int = 0


class PipelineEngine:
    """What stage workers and data nodes share: compute thread, wire format, sending, bans."""

    def __init__(self, node: Node):
        self.node = node
        self.run = node.run
        self.wire_dtype = self.run.pipeline.wire_dtype
        self.compute_thread = ComputeThread(f"compute-{node.short_id}")
        self.traffic = Traffic()
        self.banned_until: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        m, t = self.run.model, self.run.train
        self.activation_spec = TensorSpec(self.wire_dtype, (None, None, m.d_model))
        self.max_activation_bytes = t.microbatch_size * m.max_seq_len * m.d_model * DTYPE_SIZES[self.wire_dtype]

    async def compute(self, fn: Callable[..., T], *args: Any, priority: int = BACKGROUND) -> T:
        return await self.compute_thread.run(priority, fn, *args)

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        """Run work in the background, kept so shutdown can cancel it."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("[%s] %s failed: %r", self.node.short_id, task.get_name(), task.exception())

    def banned(self) -> set[str]:
        now = time.monotonic()
        return {peer for peer, until in self.banned_until.items() if until > now}

    def ban(self, peer_id: str) -> None:
        self.banned_until[peer_id] = time.monotonic() + FAILED_PEER_BAN_S

    def check_activation(self, x: torch.Tensor) -> None:
        batch, seq = x.shape[0], x.shape[1]
        if not (1 <= batch <= self.run.train.microbatch_size and 1 <= seq <= self.run.model.max_seq_len):
            raise BadTensor(
                f"activation shape {tuple(x.shape)} outside this run's microbatch "
                f"({self.run.train.microbatch_size}, {self.run.model.max_seq_len}, d)"
            )

    async def read_activation(self, stream: FramedStream) -> torch.Tensor:
        x = await stream.read_tensor(self.activation_spec, max_bytes=self.max_activation_bytes)
        self.check_activation(x)
        self.traffic.tensors_received += 1
        self.traffic.bytes_received += x.numel() * DTYPE_SIZES[self.wire_dtype]
        return x

    async def send(
        self, peer_id: str, rpc: str, request: ForwardRequest | BackwardRequest, tensor: torch.Tensor
    ) -> None:
        """Send one request and its tensor; returns when the receiver acknowledged taking it."""
        timeout_s = self.node.config.rpc_timeout_s
        try:
            stream = await open_call(self.node.dht.p2p, peer_id, rpc, timeout_s)
        except Exception as e:
            raise HopFailed(f"cannot reach {peer_id[-8:]}: {type(e).__name__}") from None
        try:
            await stream.write_message(request)
            sent = await stream.write_tensor(tensor, self.wire_dtype)
            ack = await read_reply(stream, Ack)
        except RemoteError as e:
            raise HopFailed(f"{peer_id[-8:]} refused: {e}") from None
        except Exception as e:
            raise HopFailed(f"{peer_id[-8:]} failed: {type(e).__name__} {e}"[:200]) from None
        finally:
            stream.close()
        if not ack.accepted:
            raise HopFailed(f"{peer_id[-8:]} declined: {ack.reason}")
        self.traffic.tensors_sent += 1
        self.traffic.bytes_sent += sent

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.compute_thread.shutdown()


async def push_forward(
    engine: PipelineEngine, request: ForwardRequest, tensor: torch.Tensor, attempts: int = 3
) -> ForwardRequest:
    """Deliver an activation to hop `request.hop`, re-routing that hop to another live replica of
    the same stage if its peer fails (the sender still holds the tensor, so only this hop is redone).
    Returns the request as delivered (its route may have changed); raises HopFailed if nobody took it.
    """
    failures = []
    for _ in range(attempts):
        home = request.hop == len(request.route)
        target = request.origin if home else request.route[request.hop].peer_id
        try:
            await engine.send(target, "rpc_forward", request, tensor)
            return request
        except HopFailed as e:
            failures.append(str(e))
            engine.ban(target)
            if home or engine.node.view is None:
                break
            stage = request.route[request.hop].stage
            replica = pick_replica(engine.node.view, stage, {}, exclude=engine.banned() | {target})
            if replica is None:
                failures.append(f"no other live replica of stage {stage}")
                break
            route = list(request.route)
            route[request.hop] = Hop(stage=stage, peer_id=replica.peer_id)
            logger.info(
                "[%s] re-routing %s: stage %d -> %s",
                engine.node.short_id,
                request.microbatch_id,
                stage,
                replica.peer_id[-8:],
            )
            request = ForwardRequest(
                microbatch_id=request.microbatch_id,
                origin=request.origin,
                step=request.step,
                hop=request.hop,
                route=tuple(route),
                needs_backward=request.needs_backward,
            )
    raise HopFailed("; ".join(failures)[:200])
