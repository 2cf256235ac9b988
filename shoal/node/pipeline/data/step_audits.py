"""A data node's step audits: after a sampled step, replay one replica's inner step (shoal.train.step_audit).

With probability `defense.step_audit_rate`, drawn where nobody else sees it, a data node keeps what it
sent and received in a step: each first hop's input, each last hop's output and its gradient, and the
route of every microbatch that completed. Once the workers have answered its step close (and so taken
their inner step), it picks one replica that served the step, asks it for the transcript of the inner
step that took one of those microbatches, replays the step on its own compute thread and judges it
(`shoal.train.step_audit.judge_step`). A replica that fails is excluded from this data node's routes
for the rest of the run, with the reason, like one blamed by output audits (auditor.py). A replica that
cannot produce its transcript in time is counted, not blamed: its step may wait for another data node.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from shoal.device import compute_kind
from shoal.model.stages import build_stage, over_the_wire
from shoal.node.compute import BACKGROUND
from shoal.node.context import NodeContext
from shoal.node.pipeline.data.attempts import InFlight
from shoal.node.pipeline.data.exclusions import Exclusions
from shoal.p2p.streams import read_reply
from shoal.protocol.pipeline import Ack, StepTranscriptHeader, StepTranscriptRequest
from shoal.protocol.tensors import TensorSpec
from shoal.protocol.torch_tensors import TORCH_DTYPES
from shoal.train.inner import OptimizerState
from shoal.train.outer import check_partner_tensors
from shoal.train.step_audit import Known, StepTranscript, StepVerdict, judge_step, replay_step

logger = logging.getLogger(__name__)

PENDING_RETRIES = 10
PENDING_WAIT_S = 0.5


class TranscriptPending(Exception):
    """The replica has not taken the step yet."""


class ElsewhereComputed(Exception):
    """The replica's step ran on another kind of device or dtype than our replay would."""


class StepAuditor:
    """`compute`: runs a function on the engine's compute thread; `spawn`: keeps a background task so
    shutdown can cancel it; `exclusions`: where a replica that fails goes."""

    def __init__(
        self,
        ctx: NodeContext,
        compute: Callable[..., Awaitable[Any]],
        spawn: Callable[[Awaitable[Any], str], asyncio.Future],
        exclusions: Exclusions,
    ):
        self.ctx, self.run, self.device = ctx, ctx.run, ctx.device
        self.compute, self.spawn, self.exclusions = compute, spawn, exclusions
        self.rate = self.run.defense.step_audit_rate
        self.rng = random.Random(f"{self.run.run_id}:step-audit:{self.ctx.peer_id}")
        self.wire_dtype = TORCH_DTYPES[self.run.pipeline.wire_dtype]
        self.recording = False
        self.outputs: dict[str, torch.Tensor] = {}  # wire id -> the output that came home
        self.known: dict[str, dict[str, Known]] = {}  # replica -> wire id -> what we know of it there
        self.stages: dict[str, int] = {}  # replica -> its stage
        self.compute_kind = compute_kind(self.device, self.ctx.compute_dtype)
        self.audits = self.passed = self.failed = self.inconclusive = self.elsewhere = 0
        self.discrepancies: list[float] = []
        self.audit_s: list[float] = []

    def begin(self) -> None:
        self.recording = self.rate > 0 and self.rng.random() < self.rate
        self.outputs, self.known, self.stages = {}, {}, {}

    def note_output(self, wire_id: str, y: torch.Tensor) -> None:
        if self.recording:
            self.outputs[wire_id] = y.detach()

    def note_completed(self, wire_id: str, entry: InFlight) -> None:
        """A microbatch of the recorded step completed on the route `entry` names."""
        if not self.recording:
            return
        last = len(entry.route_peers) - 1
        for k, (peer, stage) in enumerate(zip(entry.route_peers, entry.route_stages, strict=True)):
            known = Known(
                input=self._as_received(entry.embedded) if k == 0 else None,
                output_grad=self._as_received(entry.grad) if k == last and entry.grad is not None else None,
                # the output that came home is the replaced peer's where a stand-in redid the last hop
                output=self.outputs.get(wire_id) if k == last and k not in entry.redone else None,
                tokens=entry.tokens.detach() if entry.tokens is not None and entry.packed_tokens else None,
            )
            self.known.setdefault(peer, {})[wire_id] = known
            self.stages[peer] = stage

    def _as_received(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return over_the_wire(x.detach(), self.wire_dtype)

    def finish(self, step: int, closing: asyncio.Future) -> None:
        """The step is over: audit one of its replicas once the workers have taken their inner step."""
        if not self.recording or not self.known:
            return
        excluded = self.exclusions.peers()
        candidates = sorted(p for p in self.known if p not in excluded)
        if not candidates:
            return
        peer = self.rng.choice(candidates)
        known, stage = self.known[peer], self.stages[peer]
        self.recording, self.outputs, self.known = False, {}, {}
        self.spawn(self._audit_safely(step, peer, stage, known, closing), f"step audit {step}")

    async def _audit_safely(self, step: int, peer: str, stage: int, known: dict[str, Known], closing) -> None:
        try:
            await asyncio.shield(closing)
            await self._audit(step, peer, stage, known)
        except ElsewhereComputed as e:
            self.elsewhere += 1
            logger.info("[%s] step audit of %s at step %d: not replayed (%s)", self.ctx.short_id, peer[-8:], step, e)
        except Exception as e:  # a peer's failure or bad data: counted, never fatal to our run
            self.inconclusive += 1
            logger.info("[%s] step audit of %s at step %d: no verdict (%s)", self.ctx.short_id, peer[-8:], step, e)

    async def _audit(self, step: int, peer: str, stage: int, known: dict[str, Known]) -> None:
        started = time.monotonic()
        module = self._module(stage)
        named = next(iter(known))
        for attempt in range(PENDING_RETRIES):
            try:
                transcript = await self._fetch(peer, named, module)
                break
            except TranscriptPending:
                if attempt == PENDING_RETRIES - 1:
                    raise
                await asyncio.sleep(PENDING_WAIT_S)
        # every microbatch of ours it took is in that one step: a worker steps only once each data node
        # whose gradient it holds has closed that gradient's step, and holds our next step until then
        verdict: StepVerdict = await self.compute(self._judge, module, transcript, known, priority=BACKGROUND)
        self.audits += 1
        self.audit_s.append(time.monotonic() - started)
        self.discrepancies.append(verdict.discrepancy)
        if verdict.passed:
            self.passed += 1
            logger.info("[%s] step audit of %s (stage %d) at step %d passed: %.2g of a step off", self.ctx.short_id,
                        peer[-8:], stage, step, verdict.discrepancy)  # fmt: skip
            return
        self.failed += 1
        self.exclusions.exclude(peer, f"step audit at step {step}: {verdict.reason}")

    def _judge(self, module, transcript: StepTranscript, known: dict[str, Known]) -> StepVerdict:
        replayed = replay_step(module, self.run.optim, self.run.train.steps, transcript, self.wire_dtype)
        return judge_step(transcript, replayed, known)

    def _module(self, stage: int) -> torch.nn.Module:
        """The stage's architecture to replay on, built for this audit and dropped after it (its weights are
        the transcript's): a data node holds no copy of a block stage between audits."""
        run = self.run
        return build_stage(run.model, run.pipeline.stages, stage, run.train.seed).to(self.device)

    async def _fetch(self, peer: str, microbatch_id: str, module: torch.nn.Module) -> StepTranscript:
        """The transcript, checked as anything from a peer: counts, shapes, sizes, finite values."""
        reference = [p.detach() for p in module.parameters()]
        timeout_s = self.ctx.config.network.rpc_timeout_s
        stream = await self.ctx.rpc.step_transcript.open(peer, timeout_s)
        try:
            await stream.write_message(StepTranscriptRequest(microbatch_id=microbatch_id))
            ack = await read_reply(stream, Ack)
            if not ack.accepted:
                raise TranscriptPending(ack.reason) if ack.reason.startswith("pending") else RuntimeError(ack.reason)
            header = await read_reply(stream, StepTranscriptHeader)
            if header.compute != self.compute_kind:
                theirs = header.compute or "unknown"
                raise ElsewhereComputed(f"its step ran as {theirs}, ours would as {self.compute_kind}")
            counts = {len(header.adam_steps), header.tensors}
            if counts != {len(reference)} or not len(header.rows) == len(header.seq_lens) == len(header.microbatch_ids):
                raise ValueError("a transcript whose counts do not match the stage")
            tensors = [await self._read(stream, tuple(p.shape)) for _ in range(4) for p in reference]
            width, rows_max, seq_max = (
                self.run.model.residual_dim,
                self.run.train.microbatch_size,
                self.run.model.max_seq_len,
            )
            inputs, grads, token_ids = [], [], []
            for rows, seq_len in zip(header.rows, header.seq_lens, strict=True):
                if rows > rows_max or seq_len > seq_max:
                    raise ValueError(f"a transcript microbatch of {rows} x {seq_len}, over the run's")
                inputs.append(await self._read(stream, (rows, seq_len, width)))
                grads.append(await self._read(stream, (rows, seq_len, width)))
                if self.run.model.subspace_rank:
                    token_ids.append(await self._read_tokens(stream, (rows, seq_len)))
        finally:
            stream.close()
        n = len(reference)
        before, avg, avg_sq, after = (tensors[i * n : (i + 1) * n] for i in range(4))
        for group, what in ((before, "weights before"), (avg, "first moments"), (avg_sq, "second moments"),
                            (after, "weights after")):  # fmt: skip
            check_partner_tensors(group, reference, f"transcript {what}", dtype=torch.float32)
        state = OptimizerState(header.step_count, tuple(header.adam_steps), tuple(avg), tuple(avg_sq))
        return StepTranscript(header.step, header.lr_scale, state, tuple(before), tuple(after),
                              tuple(header.microbatch_ids), tuple(inputs), tuple(grads), tuple(token_ids))  # fmt: skip

    async def _read_tokens(self, stream, shape: tuple[int, int]) -> torch.Tensor:
        ids = await stream.read_exact(TensorSpec("int64", shape), max_bytes=math.prod(shape) * 8)
        if ids.numel() and bool(((ids < 0) | (ids >= self.run.model.vocab_size)).any()):
            raise ValueError("a transcript's token ids outside the vocabulary")
        return ids.to(self.device)

    async def _read(self, stream, shape: tuple[int, ...]) -> torch.Tensor:
        spec = TensorSpec("float32", shape)
        return await stream.read_tensor(spec, max_bytes=math.prod(shape) * 4, device=self.device)

    def stats(self) -> dict:
        return {
            "rate": self.rate,
            "audits": self.audits,
            "passed": self.passed,
            "failed": self.failed,
            "inconclusive": self.inconclusive,
            "elsewhere": self.elsewhere,  # steps computed on another kind of device or dtype: not replayed
            "max_discrepancy": max(self.discrepancies, default=None),
            "median_audit_s": sorted(self.audit_s)[len(self.audit_s) // 2] if self.audit_s else None,
        }
