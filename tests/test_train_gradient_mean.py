"""Stage 0's gradient mean between data nodes (shoal/train/gradient_mean.py): two nodes that step on
the pair's mean take one node's step on both halves, bit for bit."""

from __future__ import annotations

import torch

from shoal.config import OptimConfig
from shoal.train.gradient_mean import gradient_refusal, gradients_of, mean_of, set_gradients
from shoal.train.inner import InnerOptimizer


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))


def test_two_halves_averaged_step_as_one_node_on_the_whole_batch():
    batch = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1))
    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    one, halves = _model(), [_model(), _model()]
    one_opt = InnerOptimizer(one, optim, 10)
    half_opts = [InnerOptimizer(m, optim, 10) for m in halves]
    for _ in range(3):
        _loss(one, batch).backward()
        one_opt.step()
        for model, rows in zip(halves, batch.chunk(2), strict=True):
            _loss(model, rows).backward()
        grads = [gradients_of(m) for m in halves]
        for model, own, theirs in ((halves[0], grads[0], grads[1]), (halves[1], grads[1], grads[0])):
            set_gradients(model, mean_of(own, theirs))
        for opt in half_opts:
            opt.step()
    a, b = (list(m.parameters()) for m in halves)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # the pair stays bit-identical
    for x, y in zip(a, one.parameters(), strict=True):  # and steps as one node would (up to rounding)
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()


def test_a_partner_gradient_far_larger_than_ours_is_refused():
    ours = [torch.full((4,), 0.5)]
    assert gradient_refusal(ours, [torch.full((4,), 0.6)], tolerance=3.0, grad_clip=1.0) is None
    assert gradient_refusal(ours, [torch.full((4,), 1.4)], tolerance=3.0, grad_clip=1.0) is None  # under 3 x clip
    why = gradient_refusal(ours, [torch.full((4,), 100.0)], tolerance=3.0, grad_clip=1.0)
    assert why is not None and "gradient norm 200" in why


def test_a_parameter_no_gradient_reached_counts_as_zero():
    model = _model()
    _loss(model, torch.randint(0, 50, (2, 5))).backward()
    model[1].bias.grad = None
    grads = gradients_of(model)
    assert torch.count_nonzero(grads[-1]) == 0 and grads[-1].shape == (50,)
