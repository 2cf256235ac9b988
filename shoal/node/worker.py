"""A stage worker: forward and backward for its block stage, and its inner optimizer.

Forward keeps the input and output of every microbatch until its gradient comes back, bounded by
the node's advertised in-flight memory; past it, a sender is told "busy" and picks another
replica. Backward accumulates parameter gradients; the optimizer steps after the run's
microbatches-per-step have accumulated. Nothing waits on any global barrier.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shoal.model.stages import build_stage
from shoal.node.compute import BACKWARD, FORWARD
from shoal.node.hops import HopFailed, PipelineEngine, push_forward
from shoal.node.transport import FramedStream, call
from shoal.protocol.pipeline import AbandonNotice, Ack, BackwardRequest, ForwardRequest, check_hop
from shoal.protocol.tensors import TensorSpec
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)


@dataclass
class Saved:
    x: torch.Tensor  # the input, requiring grad
    y: torch.Tensor  # the output, with its graph
    expires_at: float
    origin: str  # the data node that owns the microbatch (the only peer that may release it)


class StageWorker(PipelineEngine):
    def __init__(self, node, stage: int):
        super().__init__(node)
        run = self.run
        self.stage = stage
        self.module = build_stage(run.model, run.pipeline.stages, stage, run.train.seed)
        self.optimizer = InnerOptimizer(self.module, run.optim, run.train.steps)
        self.saved: dict[str, Saved] = {}
        self.reserved = 0  # forwards accepted but not yet saved
        self.live_graphs = 0  # forward graphs (made on the compute thread) whose backward has not run
        self.accumulated = 0
        self.forwards = 0
        self.backwards = 0
        self.expired = 0

    @property
    def busy(self) -> bool:
        return bool(self.saved) or self.reserved > 0

    def _check_mine(self, request: ForwardRequest | BackwardRequest) -> str | None:
        check_hop(request)
        if request.hop < 0 or request.hop >= len(request.route):
            return "this node is not the data node of that microbatch"
        hop = request.route[request.hop]
        if hop.peer_id != self.node.peer_id or hop.stage != self.stage:
            return f"this node holds stage {self.stage}, not stage {hop.stage}"
        return None

    async def on_forward(self, request: ForwardRequest, stream: FramedStream) -> Ack:
        refusal = self._check_mine(request)
        x = await self.read_activation(stream)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        if request.needs_backward and len(self.saved) + self.reserved >= self.node.max_inflight:
            return Ack(accepted=False, reason=f"busy: {self.node.max_inflight} microbatches in flight")
        self.reserved += 1
        self.spawn(self._forward(request, x), f"forward {request.microbatch_id}")
        return Ack(accepted=True)

    def _run_forward(self, x: torch.Tensor, needs_backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not needs_backward:
            with torch.no_grad():
                return x, self.module(x)
        x = x.requires_grad_(True)
        with torch.enable_grad():
            y = self.module(x)
        self.live_graphs += 1
        return x, y

    async def _forward(self, request: ForwardRequest, x: torch.Tensor) -> None:
        try:
            x, y = await self.compute(self._run_forward, x, request.needs_backward, priority=FORWARD)
            if request.needs_backward:
                expires_at = time.monotonic() + self.node.config.microbatch_timeout_s
                self.saved[request.microbatch_id] = Saved(x, y, expires_at, request.origin)
        finally:
            self.reserved -= 1
        self.forwards += 1
        onward = ForwardRequest(
            microbatch_id=request.microbatch_id,
            origin=request.origin,
            step=request.step,
            hop=request.hop + 1,
            route=request.route,
            needs_backward=request.needs_backward,
        )
        try:
            await push_forward(self, onward, y.detach())
        except HopFailed as e:
            self._drop(request.microbatch_id)
            await self.notify_abandon(request.origin, request.microbatch_id, f"forward after stage {self.stage}: {e}")

    async def on_backward(self, request: BackwardRequest, stream: FramedStream) -> Ack:
        refusal = self._check_mine(request)
        saved = self.saved.get(request.microbatch_id)
        spec = TensorSpec(self.wire_dtype, tuple(saved.y.shape)) if saved is not None else self.activation_spec
        grad = await stream.read_tensor(spec, max_bytes=self.max_activation_bytes)
        if refusal:
            return Ack(accepted=False, reason=refusal)
        if saved is None:
            return Ack(accepted=False, reason="unknown or expired microbatch")
        del self.saved[request.microbatch_id]
        self.spawn(self._backward(request, saved, grad), f"backward {request.microbatch_id}")
        return Ack(accepted=True)

    def _run_backward(self, saved: Saved, grad: torch.Tensor) -> torch.Tensor:
        saved.y.backward(grad)
        self.live_graphs -= 1
        self.accumulated += 1
        self._maybe_step()
        assert saved.x.grad is not None, "backward produced no input gradient"
        return saved.x.grad

    def _maybe_step(self) -> None:
        """Step once a batch of gradient has accumulated and no saved graph is waiting for its
        gradient: AdamW updates weights in place, which would corrupt the graphs of microbatches
        already forwarded with the old weights. (With one data node per step barrier this is the end
        of every step; with several unsynchronised data nodes a step can wait and take a larger batch.)"""
        if self.accumulated >= self.run.microbatches_per_step and self.live_graphs == 0:
            stats = self.optimizer.step()
            self.accumulated = 0
            self.node.inner_step = self.optimizer.step_count
            self.node.grad_norm = stats.grad_norm

    async def _backward(self, request: BackwardRequest, saved: Saved, grad: torch.Tensor) -> None:
        grad_in = await self.compute(self._run_backward, saved, grad, priority=BACKWARD)
        self.backwards += 1
        upstream = BackwardRequest(
            microbatch_id=request.microbatch_id,
            origin=request.origin,
            step=request.step,
            hop=request.hop - 1,
            route=request.route,
        )
        target = request.origin if upstream.hop < 0 else request.route[upstream.hop].peer_id
        try:
            await self.send(target, "rpc_backward", upstream, grad_in)
        except HopFailed as e:
            # the upstream hop held the graph this gradient belongs to: without it, the microbatch ends here
            self.ban(target)
            await self.notify_abandon(request.origin, request.microbatch_id, f"backward into hop {upstream.hop}: {e}")

    async def notify_abandon(self, origin: str, microbatch_id: str, reason: str) -> None:
        logger.warning("[%s] %s abandoned: %s", self.node.short_id, microbatch_id, reason)
        try:
            await call(
                self.node.dht.p2p,
                origin,
                "rpc_abandon",
                AbandonNotice(microbatch_id=microbatch_id, reason=reason[:200]),
                Ack,
                timeout_s=self.node.config.rpc_timeout_s,
            )
        except Exception as e:
            logger.info("[%s] could not tell %s: %s", self.node.short_id, origin[-8:], e)

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        """The data node gave this microbatch up: drop its saved activations now."""
        saved = self.saved.get(notice.microbatch_id)
        if saved is None or saved.origin != sender:
            return Ack(accepted=False, reason="nothing kept for that microbatch from that data node")
        self._drop(notice.microbatch_id)
        return Ack(accepted=True)

    def expire(self) -> int:
        """Drop saved activations whose gradient never came (its microbatch was abandoned downstream)."""
        now = time.monotonic()
        stale = [mb for mb, s in self.saved.items() if s.expires_at < now]
        for mb in stale:
            self._drop(mb)
        self.expired += len(stale)
        return len(stale)

    def _drop(self, microbatch_id: str) -> None:
        """Forget a microbatch whose gradient will never come; a pending step may then proceed."""
        if self.saved.pop(microbatch_id, None) is not None:
            self.live_graphs -= 1
            if self.accumulated >= self.run.microbatches_per_step:
                self.spawn(self.compute(self._maybe_step), "deferred step")

    def stats(self) -> dict:
        return {
            "forwards": self.forwards,
            "backwards": self.backwards,
            "inner_steps": self.optimizer.step_count,
            "in_flight": len(self.saved),
            "expired": self.expired,
        }
