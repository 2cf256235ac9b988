"""How the decoder splits into pipeline stages, and running a microbatch through any route.

A route is an ordered list of block stages. The full pipeline is [1, 2, ..., S-1]; later work
skips stages or swaps neighbours (SkipPipe, CheckFree+), so nothing here assumes the order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.model.config import ModelConfig
from shoal.model.llama import BlockStage, HeadStage
from shoal.protocol.torch_tensors import round_trip_rows


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The blocks stage `stage` owns: stage 0 none, stages 1..S-1 a balanced contiguous split."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    if stage == 0:
        return range(0, 0)
    block_stages = stages - 1
    if block_stages > n_layers:
        raise ValueError(f"{block_stages} block stages but only {n_layers} blocks")
    base, extra = divmod(n_layers, block_stages)
    k = stage - 1
    start = k * base + min(k, extra)
    return range(start, start + base + (1 if k < extra else 0))


def build_stage(cfg: ModelConfig, stages: int, stage: int, seed: int) -> HeadStage | BlockStage:
    """Deterministic in (cfg, stages, stage, seed): every replica of a stage starts bit-identical."""
    if stage == 0:
        return HeadStage(cfg, seed)
    return BlockStage(cfg, stage_layers(cfg.n_layers, stages, stage), seed)


def build_all_stages(cfg: ModelConfig, stages: int, seed: int) -> tuple[HeadStage, list[BlockStage]]:
    head = build_stage(cfg, stages, 0, seed)
    blocks = [build_stage(cfg, stages, s, seed) for s in range(1, stages)]
    return head, blocks  # type: ignore[return-value]


class _WireRound(torch.autograd.Function):
    """A hop's rounding, both ways: the activation crosses as the wire dtype, and so does its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.wire_dtype = wire_dtype
        return x.to(wire_dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.wire_dtype).to(grad.dtype), None


class _WireInt8(torch.autograd.Function):
    """An int8 hop, both ways: each row of the activation, and of its gradient, quantized to int8 with
    its own absolute-maximum scale and rebuilt, exactly as the receiving peer rebuilds it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return round_trip_rows(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return round_trip_rows(grad)


def over_the_wire(x: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """`x` as the next peer receives it, and its gradient as the sender gets it back: identity for a
    float32 wire, a rounding both ways for a narrower one (`pipeline.wire_dtype`), per-row int8
    quantization both ways for `int8`."""
    if wire_dtype == torch.int8:
        return _WireInt8.apply(x)
    return x if wire_dtype == x.dtype else _WireRound.apply(x, wire_dtype)


def forward_route(
    head: HeadStage,
    route: Sequence[BlockStage],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    wire_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Loss of one microbatch through the block stages in `route` order, in one autograd graph, with
    every hop's rounding to `wire_dtype` on the way out and back, as between peers."""
    x = over_the_wire(head.embed(tokens), wire_dtype)
    for stage in route:
        x = over_the_wire(stage(x, tokens), wire_dtype)
    return head.loss(x, targets, tokens)


def hop_by_hop_step(
    head: HeadStage,
    route: Sequence[BlockStage],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    loss_scale: float = 1.0,
    wire_dtype: torch.dtype = torch.float32,
) -> float:
    """Forward and backward the way the swarm does it: each hop sees only a detached input.

    Every hop keeps its own graph, the gradient of the next hop's input crosses the boundary as a
    plain tensor, and both cross as `wire_dtype`. Accumulates parameter gradients (scaled by
    `loss_scale`) and returns the loss.
    """

    def cross(t: torch.Tensor) -> torch.Tensor:
        return over_the_wire(t.detach(), wire_dtype)

    embedded = head.embed(tokens)
    inputs, outputs = [], []
    x = cross(embedded)
    for stage in route:
        x_in = x.requires_grad_(True)
        x_out = stage(x_in, tokens)
        inputs.append(x_in)
        outputs.append(x_out)
        x = cross(x_out)
    last = x.requires_grad_(True)
    loss = head.loss(last, targets, tokens)
    (loss * loss_scale).backward()
    grad = cross(last.grad)
    for x_in, x_out in zip(reversed(inputs), reversed(outputs), strict=True):
        x_out.backward(grad)
        grad = cross(x_in.grad)
    embedded.backward(grad)
    return float(loss.detach())
