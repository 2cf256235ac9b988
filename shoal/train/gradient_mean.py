"""Stage 0 as data parallelism: data nodes average its gradients before each optimizer step.

Stage 0 (embedding, final norm, LM head) is held by every data node, each on its own shard. Averaging
its weights after each node's AdamW step on half the batch is not one AdamW step on the whole batch:
each node's moments follow its own half, and the two land 0.05-0.13 nats behind one data node
(docs/benchmarks.md, "Data nodes"). Averaging the gradients first is what data parallelism does:
two nodes that start from the same weights and moments and step on the same mean gradient stay
bit-identical, and take the step one node would take on both halves.

Both sides of a pair average the gradients as the partner decodes them (`sent`), so with a lossy
codec they still step on the same tensor. A pair is screened first: a partner's gradient may have at
most `tolerance` times the norm ours has (or the clip, if larger), since honest halves of one batch
have norms alike; refused, the node steps on its own gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.train.robust import norm

Tensors = Sequence[torch.Tensor]


def gradient_refusal(own: Tensors, theirs: Tensors, tolerance: float, grad_clip: float) -> str | None:
    """Why a partner's stage-0 gradients are not averaged in (None: they are). The tensors are checked
    already (count, shape, finite: outer.check_partner_tensors)."""
    own_norm, their_norm = norm(own), norm(theirs)
    limit = tolerance * max(own_norm, grad_clip)
    if their_norm > limit:
        return f"gradient norm {their_norm:.4g} is over {limit:.4g} ({tolerance:g} x max(ours {own_norm:.4g}, clip))"
    return None


def mean_of(own: Tensors, theirs: Tensors) -> list[torch.Tensor]:
    """(a + b) / 2 per tensor, in float32: the same bits on both sides of a pair, whichever is `own`."""
    return [(a.float() + b.to(a.device).float()) / 2 for a, b in zip(own, theirs, strict=True)]


def gradients_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's accumulated gradient in float32 (zeros where none reached it this step)."""
    return [
        p.grad.detach().float() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for p in module.parameters()
    ]


def set_gradients(module: torch.nn.Module, grads: Tensors) -> None:
    """Replace each parameter's gradient with `grads` (cast to the parameter's dtype and device)."""
    params = list(module.parameters())
    if len(params) != len(grads):
        raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
    for p, g in zip(params, grads, strict=True):
        p.grad = g.detach().to(device=p.device, dtype=p.dtype).clone()
