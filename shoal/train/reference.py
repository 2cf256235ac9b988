"""The single-process reference trainer: the whole model in one process, through the stage modules.

It trains exactly what the swarm trains (the same stages, the same per-stage inner optimizers,
the same data order for shard 0 of 1, every hop's rounding to the run's wire dtype), so it is both
the loss baseline the swarm must match and the speed baseline it must approach.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.config import RunConfig
from shoal.device import autocast, autocast_dtype, to_device
from shoal.model.checkpoint import Checkpoint
from shoal.model.hf import load_stage_weights
from shoal.model.stages import build_all_stages, forward_route
from shoal.protocol.torch_tensors import TORCH_DTYPES
from shoal.train.data import BatchSampler, TokenSplits, validation_batches
from shoal.train.inner import InnerOptimizer


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    val_loss: float | None = None  # after this step, where train.eval_every asks for it


@dataclass
class TrainResult:
    steps: int
    initial_loss: float
    final_loss: float
    val_loss: float
    tokens_per_s: float
    params: int
    wall_s: float
    history: list[StepRecord] = field(default_factory=list)


class ReferenceTrainer:
    def __init__(
        self,
        run: RunConfig,
        splits: TokenSplits,
        checkpoint: Checkpoint | None = None,
        device: torch.device | None = None,
    ):
        """`checkpoint`: the one a run imported from a checkpoint starts from (verified by the caller).
        `device` (default the CPU): where it computes, with the run's compute precision there, as a node."""
        if run.model.checkpoint and checkpoint is None:
            raise ValueError(f"run {run.name} starts from a checkpoint: pass it")
        self.run = run
        self.splits = splits
        self.device = device or torch.device("cpu")
        self.compute_dtype = autocast_dtype(self.device, run.pipeline.compute_dtype)
        self.head, self.blocks = build_all_stages(run.model, run.pipeline.stages, run.train.seed)
        if checkpoint is not None:
            for module in (self.head, *self.blocks):
                load_stage_weights(module, run.model, checkpoint)
        modules = [m.to(self.device) for m in (self.head, *self.blocks)]
        self.optimizers = [InnerOptimizer(m, run.optim, run.train.steps) for m in modules]
        self.sampler = BatchSampler(splits.train, run.train.seq_len, run.train.batch_size, run.train.seed)
        self.params = sum(p.numel() for m in modules for p in m.parameters())
        self.wire_dtype = TORCH_DTYPES[run.pipeline.wire_dtype]

    def train_step(self, step: int) -> float:
        """One optimizer step over `batch_size` sequences, in microbatches; returns the mean loss."""
        inputs, targets = self.sampler.batch(step)
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        n_micro = self.run.microbatches_per_step
        total = 0.0
        for mb_inputs, mb_targets in zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True):
            with autocast(self.device, self.compute_dtype):
                loss = forward_route(self.head, self.blocks, mb_inputs, mb_targets, self.wire_dtype)
            (loss / n_micro).backward()
            total += float(loss.detach())
        for optimizer in self.optimizers:
            optimizer.step()
        return total / n_micro

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole model's logits for `tokens` (B, T), in full precision: no wire cast between stages."""
        tokens = to_device(tokens, self.device)
        x = self.head.embed(tokens)
        for stage in self.blocks:
            x = stage(x, tokens)
        return self.head.logits(x, tokens)

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.run.train
        losses = []
        for x, y in validation_batches(self.splits.val, t.seq_len, t.batch_size, t.eval_batches):
            with autocast(self.device, self.compute_dtype):
                x, y = to_device(x, self.device), to_device(y, self.device)
                losses.append(float(forward_route(self.head, self.blocks, x, y, self.wire_dtype)))
        if not losses:
            raise ValueError("validation split too small for one batch")
        return sum(losses) / len(losses)

    def train(self, on_step: Callable[[StepRecord], None] | None = None) -> TrainResult:
        tokens_per_step = self.run.train.batch_size * self.run.train.seq_len
        history: list[StepRecord] = []
        train_s = 0.0
        for step in range(self.run.train.steps):
            started = time.perf_counter()
            loss = self.train_step(step)  # float(loss) waits for the device
            elapsed = time.perf_counter() - started
            train_s += elapsed
            lr = self.optimizers[0].adamw.param_groups[0]["lr"]
            record = StepRecord(step=step, loss=loss, lr=lr, tokens_per_s=tokens_per_step / elapsed)
            if self.run.train.evaluates_after(step):
                record.val_loss = self.evaluate()
            history.append(record)
            if on_step:
                on_step(record)
        val_loss = self.evaluate()
        return TrainResult(
            steps=len(history),
            initial_loss=history[0].loss,
            final_loss=sum(r.loss for r in history[-5:]) / len(history[-5:]),
            val_loss=val_loss,
            tokens_per_s=tokens_per_step * len(history) / train_s,
            params=self.params,
            wall_s=train_s,
            history=history,
        )
