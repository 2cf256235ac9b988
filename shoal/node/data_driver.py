"""A data node: samples its shard, embeds, routes microbatches through the swarm, computes the
loss when an activation comes home, sends the gradient back, and steps the embedding and head.

Every microbatch it injects ends in its ledger as completed or abandoned with a reason; a step
waits for its microbatches to end (or time out), never for the whole swarm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from shoal.model.data import BatchSampler, load_token_splits, validation_batches
from shoal.model.stages import build_stage
from shoal.node.compute import BACKWARD, FORWARD
from shoal.node.hops import HopFailed, PipelineEngine, push_forward
from shoal.node.ledger import MicrobatchLedger
from shoal.node.transport import FramedStream, call
from shoal.planning.routing import choose_route, full_pipeline
from shoal.protocol.pipeline import AbandonNotice, Ack, BackwardRequest, ForwardRequest, Hop, check_hop
from shoal.protocol.tensors import TensorSpec
from shoal.train.inner import InnerOptimizer

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    embedded: torch.Tensor  # (B, T, C) with its graph back to the embedding
    targets: torch.Tensor  # (B, T)
    loss_scale: float
    done: asyncio.Future
    loss: float | None = None
    route_peers: tuple[str, ...] = ()
    injected_at: float = field(default_factory=time.monotonic)


@dataclass
class StepResult:
    step: int
    loss: float | None
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)


class DataDriver(PipelineEngine):
    def __init__(self, node, shard: int = 0, num_shards: int = 1, progress_path: str | None = None):
        super().__init__(node)
        run = self.run
        self.head = build_stage(run.model, run.pipeline.stages, 0, run.train.seed)
        self.optimizer = InnerOptimizer(self.head, run.optim, run.train.steps)
        self.shard, self.num_shards = shard, num_shards
        self.progress_path = progress_path
        self.ledger = MicrobatchLedger()
        self.in_flight: dict[str, InFlight] = {}
        self.load: Counter = Counter()
        self.history: list[StepResult] = []
        self.splits = None
        self.sampler: BatchSampler | None = None
        self.finished = asyncio.Event()
        self.summary: dict = {}

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    async def prepare(self) -> None:
        run = self.run
        self.splits = await self.compute(load_token_splits, run.data, run.model.vocab_size)
        self.sampler = BatchSampler(
            self.splits.train, run.train.seq_len, run.train.batch_size, run.train.seed, self.shard, self.num_shards
        )

    def _progress(self, event: dict) -> None:
        if self.progress_path:
            with open(self.progress_path, "a") as f:
                f.write(json.dumps(event) + "\n")

    async def wait_for_pipeline(self, poll_s: float = 0.5, report_s: float = 10.0) -> None:
        """Until every block stage has a live replica; says which are missing while it waits."""
        started = last_report = time.monotonic()
        while True:
            view = self.node.view
            if view is not None and choose_route(view, full_pipeline(view), {}) is not None:
                return
            if view is not None and time.monotonic() - last_report >= report_s:
                missing = [s for s in full_pipeline(view) if not view.replicas(s)]
                logger.warning(
                    "[%s] waiting %.0f s for a replica of stage(s) %s before training",
                    self.node.short_id,
                    time.monotonic() - started,
                    missing,
                )
                last_report = time.monotonic()
            await asyncio.sleep(poll_s)
            self.node.view = await self.node.dht.read_view(self.run)

    # ---- the training loop ---------------------------------------------------------------------

    async def train(self) -> None:
        assert self.sampler is not None, "prepare() first"
        await self.wait_for_pipeline()
        started = time.monotonic()
        self._progress({"event": "start", "peer_id": self.node.peer_id, "run_id": self.run.run_id})
        for step in range(self.run.train.steps):
            result = await self.train_step(step)
            self.history.append(result)
            self.node.loss = result.loss
            self._progress(
                {
                    "event": "step",
                    "step": step,
                    "loss": result.loss,
                    "tokens": result.tokens,
                    "step_s": result.seconds,
                    "elapsed_s": time.monotonic() - started,
                    "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                    "in_flight": self.ledger.in_flight,
                    **self.ledger.summary(),
                    **result.extra,
                }
            )
        val_loss = await self.evaluate()
        losses = [r.loss for r in self.history if r.loss is not None]
        tail = losses[-5:]
        self.summary = {
            "steps": len(self.history),
            "initial_loss": losses[0] if losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": val_loss,
            "train_s": time.monotonic() - started,
            "tokens_per_s": sum(r.tokens for r in self.history) / max(sum(r.seconds for r in self.history), 1e-9),
            **self.ledger.summary(),
        }
        self._progress({"event": "done", **self.summary})
        self.finished.set()

    async def train_step(self, step: int) -> StepResult:
        assert self.sampler is not None
        started = time.monotonic()
        inputs, targets = self.sampler.batch(step)
        n_micro = self.run.microbatches_per_step
        slots = asyncio.Semaphore(self.node.max_inflight)
        pieces = zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True)
        jobs = [
            asyncio.create_task(self._microbatch(f"{step}.{i}", step, x, y, 1.0 / n_micro, slots))
            for i, (x, y) in enumerate(pieces)
        ]
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        stats = await self.compute(self.optimizer.step)
        self.node.inner_step, self.node.grad_norm = self.optimizer.step_count, stats.grad_norm
        tokens_per_microbatch = inputs.numel() // n_micro
        return StepResult(
            step=step,
            loss=sum(losses) / len(losses) if losses else None,
            tokens=len(losses) * tokens_per_microbatch,
            seconds=time.monotonic() - started,
            extra={"lr": stats.lr},
        )

    @torch.no_grad()
    def _embed_eval(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed(tokens)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return self.head.embed(tokens)

    async def _microbatch(
        self,
        tag: str,
        step: int,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_scale: float,
        slots: asyncio.Semaphore,
        train: bool = True,
    ) -> float | None:
        """Inject one microbatch and wait for its fate; returns its loss if it completed."""
        microbatch_id = f"{self.node.short_id}-{tag}" if train else f"{self.node.short_id}-eval-{tag}"
        async with slots:
            self.ledger.inject(microbatch_id)
            view = self.node.view
            route = choose_route(view, full_pipeline(view), self.load, self.banned()) if view else None
            if route is None:
                self.ledger.abandon(microbatch_id, "no live replica for some stage")
                return None
            embedded = await self.compute(self._embed if train else self._embed_eval, tokens, priority=FORWARD)
            done = asyncio.get_running_loop().create_future()
            entry = InFlight(embedded, targets, loss_scale, done, route_peers=tuple(p for _, p in route))
            self.in_flight[microbatch_id] = entry
            self.load.update(entry.route_peers)
            request = ForwardRequest(
                microbatch_id=microbatch_id,
                origin=self.node.peer_id,
                step=step,
                hop=0,
                route=tuple(Hop(stage=s, peer_id=p) for s, p in route),
                needs_backward=train,
            )
            try:
                await push_forward(self, request, embedded.detach())
                await asyncio.wait_for(asyncio.shield(done), self.node.config.microbatch_timeout_s)
            except HopFailed as e:
                self.ledger.abandon(microbatch_id, f"forward into stage {route[0][0]}: {e}")
            except TimeoutError:
                self.ledger.abandon(microbatch_id, f"timed out after {self.node.config.microbatch_timeout_s:.0f} s")
            finally:
                self.in_flight.pop(microbatch_id, None)
                self.load.subtract(entry.route_peers)
            return entry.loss if done.done() and not done.result() else None

    def _finish(self, microbatch_id: str, reason: str | None) -> None:
        """End a microbatch: reason None means completed."""
        entry = self.in_flight.get(microbatch_id)
        ended = self.ledger.complete(microbatch_id) if reason is None else self.ledger.abandon(microbatch_id, reason)
        if ended and entry is not None and not entry.done.done():
            entry.done.set_result(reason)
        if ended and reason is not None and entry is not None:
            self.spawn(self._release_route(microbatch_id, entry.route_peers, reason), f"release {microbatch_id}")

    async def _release_route(self, microbatch_id: str, peers: tuple[str, ...], reason: str) -> None:
        """Tell the hops of an abandoned microbatch to drop what they keep for it (their next
        optimizer step waits for such graphs), instead of holding it until it expires."""
        notice = AbandonNotice(microbatch_id=microbatch_id, reason=reason[:200])
        for peer in set(peers) - self.banned():
            try:
                await call(self.node.dht.p2p, peer, "rpc_abandon", notice, Ack, timeout_s=5.0)
            except Exception as e:
                logger.debug("[%s] could not release %s on %s: %s", self.node.short_id, microbatch_id, peer[-8:], e)

    # ---- RPC handlers: an activation coming home, a gradient reaching the embedding ------------

    async def on_forward(self, request: ForwardRequest, stream: FramedStream) -> Ack:
        check_hop(request)
        x = await self.read_activation(stream)
        entry = self.in_flight.get(request.microbatch_id)
        if request.hop != len(request.route) or request.origin != self.node.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None or not self.ledger.is_open(request.microbatch_id):
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        if tuple(x.shape[:2]) != tuple(entry.targets.shape):
            return Ack(accepted=False, reason=f"activation shape {tuple(x.shape)} does not match the microbatch")
        entry.route_peers = tuple(hop.peer_id for hop in request.route)  # as delivered, after any re-routing
        logger.debug("%s home after %.1f ms", request.microbatch_id, 1e3 * (time.monotonic() - entry.injected_at))
        self.spawn(self._loss_and_backward(request, entry, x), f"loss {request.microbatch_id}")
        return Ack(accepted=True)

    def _loss_and_grad(self, entry: InFlight, x: torch.Tensor, train: bool) -> tuple[float, torch.Tensor | None]:
        if not train:
            with torch.no_grad():
                return float(self.head.loss(x, entry.targets)), None
        x = x.requires_grad_(True)
        with torch.enable_grad():
            loss = self.head.loss(x, entry.targets)
            (loss * entry.loss_scale).backward()
        return float(loss.detach()), x.grad

    async def _loss_and_backward(self, request: ForwardRequest, entry: InFlight, x: torch.Tensor) -> None:
        entry.loss, grad = await self.compute(self._loss_and_grad, entry, x, request.needs_backward, priority=BACKWARD)
        if grad is None:
            self._finish(request.microbatch_id, None)
            return
        last = len(request.route) - 1
        backward = BackwardRequest(
            microbatch_id=request.microbatch_id, origin=request.origin, step=request.step, hop=last, route=request.route
        )
        try:
            await self.send(request.route[last].peer_id, "rpc_backward", backward, grad)
        except HopFailed as e:
            self.ban(request.route[last].peer_id)
            self._finish(request.microbatch_id, f"backward into stage {request.route[last].stage}: {e}")

    async def on_backward(self, request: BackwardRequest, stream: FramedStream) -> Ack:
        check_hop(request)
        entry = self.in_flight.get(request.microbatch_id)
        spec = TensorSpec(self.wire_dtype, tuple(entry.embedded.shape)) if entry else self.activation_spec
        grad = await stream.read_tensor(spec, max_bytes=self.max_activation_bytes)
        if request.hop != -1 or request.origin != self.node.peer_id:
            return Ack(accepted=False, reason="this data node holds no block stage")
        if entry is None or not self.ledger.is_open(request.microbatch_id):
            return Ack(accepted=False, reason="unknown or abandoned microbatch")
        self.spawn(self._embedding_backward(request.microbatch_id, entry, grad), f"embed-bwd {request.microbatch_id}")
        return Ack(accepted=True)

    async def _embedding_backward(self, microbatch_id: str, entry: InFlight, grad: torch.Tensor) -> None:
        await self.compute(entry.embedded.backward, grad, priority=BACKWARD)
        logger.debug("%s done after %.1f ms", microbatch_id, 1e3 * (time.monotonic() - entry.injected_at))
        self._finish(microbatch_id, None)

    def reap_lost(self, live_peers: set[str]) -> int:
        """Abandon in-flight microbatches routed through a peer that left the swarm (its record
        expired or says `leaving`): their activations are gone with it, so waiting is pointless."""
        lost = [
            (mb, next(p for p in entry.route_peers if p not in live_peers))
            for mb, entry in self.in_flight.items()
            if not set(entry.route_peers) <= live_peers
        ]
        for microbatch_id, peer in lost:
            self._finish(microbatch_id, f"peer {peer[-8:]} left the swarm")
        return len(lost)

    def _holds_block_stage(self, peer_id: str) -> bool:
        """A live stage worker of this run (a hop may have been re-routed to it on the way)."""
        view = self.node.view
        return view is not None and any(n.peer_id == peer_id and n.stage > 0 for n in view.live_nodes())

    async def on_abandon(self, notice: AbandonNotice, sender: str) -> Ack:
        entry = self.in_flight.get(notice.microbatch_id)
        if entry is None or not self.ledger.is_open(notice.microbatch_id):
            return Ack(accepted=False, reason="unknown microbatch")
        if sender not in entry.route_peers and not self._holds_block_stage(sender):
            return Ack(accepted=False, reason="only a hop of that microbatch may abandon it")
        self._finish(notice.microbatch_id, notice.reason)
        return Ack(accepted=True)

    # ---- evaluation ----------------------------------------------------------------------------

    async def evaluate(self) -> float | None:
        """Validation loss of the whole swarm model, forward only, over the shared validation batches."""
        t = self.run.train
        slots = asyncio.Semaphore(self.node.max_inflight)
        jobs = []
        for b, (x, y) in enumerate(validation_batches(self.splits.val, t.seq_len, t.batch_size, t.eval_batches)):
            for i, (xm, ym) in enumerate(
                zip(x.chunk(self.run.microbatches_per_step), y.chunk(self.run.microbatches_per_step), strict=True)
            ):
                jobs.append(self._microbatch(f"{b}.{i}", -1, xm, ym, 1.0, slots, train=False))
        losses = [loss for loss in await asyncio.gather(*jobs) if loss is not None]
        return sum(losses) / len(losses) if losses else None

    def stats(self) -> dict:
        return {"steps": len(self.history), **self.ledger.summary(), **self.summary}
