from __future__ import annotations

import pytest
import torch

from shoal.model.config import ModelConfig
from shoal.model.llama import Llama
from shoal.model.split_backward import input_grad_first, recording_linears
from shoal.model.stages import (
    build_all_stages,
    build_stage,
    forward_route,
    hop_by_hop_step,
    over_the_wire,
    stage_layers,
)

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=5, n_heads=4, ffn_hidden=64, max_seq_len=16)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (3, 12), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (3, 12), generator=g)
    return tokens, targets


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
def test_stage_layers_partition_all_blocks_contiguously(stages):
    ranges = [stage_layers(CFG.n_layers, stages, s) for s in range(stages)]
    assert len(ranges[0]) == 0
    flat = [i for r in ranges[1:] for i in r]
    assert flat == list(range(CFG.n_layers))
    sizes = [len(r) for r in ranges[1:]]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_more_block_stages_than_blocks_is_refused():
    with pytest.raises(ValueError, match="block stages"):
        stage_layers(CFG.n_layers, CFG.n_layers + 2, 1)


@pytest.mark.parametrize("stages", [2, 3, 6])
def test_chained_stages_equal_unsplit_model_forward_and_gradients(stages):
    tokens, targets = _batch()
    reference = Llama(CFG, seed=7)
    ref_loss = reference(tokens, targets)
    ref_loss.backward()

    head, blocks = build_all_stages(CFG, stages, seed=7)
    loss = hop_by_hop_step(head, blocks, tokens, targets)
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)

    ref_blocks = dict(reference.blocks.named_parameters())
    for stage in blocks:
        for name, param in stage.blocks.named_parameters():
            local, rest = name.split(".", 1)
            ref = ref_blocks[f"{stage.layers[int(local)]}.{rest}"]
            torch.testing.assert_close(param, ref, rtol=0, atol=0)
            torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)
    for name, param in head.named_parameters():
        ref = dict(reference.head.named_parameters())[name]
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_hop_by_hop_gradients_match_one_graph():
    tokens, targets = _batch(1)
    head_a, blocks_a = build_all_stages(CFG, 4, seed=3)
    head_b, blocks_b = build_all_stages(CFG, 4, seed=3)
    forward_route(head_a, blocks_a, tokens, targets).mul(0.5).backward()
    hop_by_hop_step(head_b, blocks_b, tokens, targets, loss_scale=0.5)
    for a, b in zip([head_a, *blocks_a], [head_b, *blocks_b], strict=True):
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7)


def test_a_narrow_wire_rounds_the_activation_out_and_its_gradient_back():
    x = torch.randn(2, 3, 8, requires_grad=True)
    grad = torch.randn(2, 3, 8)
    y = over_the_wire(x, torch.bfloat16)
    y.backward(grad)
    assert y.dtype == torch.float32
    assert torch.equal(y, x.detach().to(torch.bfloat16).float()) and not torch.equal(y, x.detach())
    assert torch.equal(x.grad, grad.to(torch.bfloat16).float()) and not torch.equal(x.grad, grad)
    assert over_the_wire(x, torch.float32) is x  # a float32 wire costs nothing


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_the_one_graph_route_rounds_at_every_hop_as_the_hop_by_hop_step_does(wire):
    """The reference trainer (one graph) trains what the swarm trains over a narrow wire."""
    tokens, targets = _batch(1)
    head_a, blocks_a = build_all_stages(CFG, 4, seed=3)
    head_b, blocks_b = build_all_stages(CFG, 4, seed=3)
    head_c, blocks_c = build_all_stages(CFG, 4, seed=3)
    forward_route(head_a, blocks_a, tokens, targets, wire_dtype=wire).mul(0.5).backward()
    hop_by_hop_step(head_b, blocks_b, tokens, targets, loss_scale=0.5, wire_dtype=wire)
    forward_route(head_c, blocks_c, tokens, targets).mul(0.5).backward()
    apart_from_float32 = 0.0
    for a, b, c in zip([head_a, *blocks_a], [head_b, *blocks_b], [head_c, *blocks_c], strict=True):
        for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7)
            apart_from_float32 = max(apart_from_float32, float((pa.grad - pc.grad).abs().max()))
    assert apart_from_float32 > 1e-5  # the rounding is really there


def test_building_a_stage_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(1)
    a = build_stage(CFG, 3, 2, seed=11)
    torch.manual_seed(2)
    _ = torch.randn(100)
    b = build_stage(CFG, 3, 2, seed=11)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb)
    c = build_stage(CFG, 3, 2, seed=12)
    assert not torch.equal(a.state_dict()["blocks.0.attn.qkv.weight"], c.state_dict()["blocks.0.attn.qkv.weight"])


def test_same_block_has_same_weights_under_any_split():
    three = build_stage(CFG, 3, 2, seed=5)  # blocks 3..4 of 5 with 2 block stages
    six = build_stage(CFG, 6, 4, seed=5)  # block 3 alone
    assert three.layers[0] == six.layers[0] == 3
    assert torch.equal(three.blocks[0].mlp.up.weight, six.blocks[0].mlp.up.weight)


def test_route_order_matters():
    tokens, targets = _batch(2)
    head, blocks = build_all_stages(CFG, 4, seed=0)
    with torch.no_grad():
        in_order = forward_route(head, blocks, tokens, targets)
        swapped = forward_route(head, [blocks[1], blocks[0], blocks[2]], tokens, targets)
        skipped = forward_route(head, [blocks[0], blocks[2]], tokens, targets)
    assert float(in_order) != float(swapped)
    assert float(in_order) != float(skipped)


def test_the_heads_split_backward_adds_exactly_what_one_backward_would():
    """The data node sends the gradient in its input first and adds the LM head's weight gradient
    later (zero-bubble's B/W split): over several microbatches, bit for bit what `backward` adds,
    whether each W pass runs at once or after later microbatches' B passes."""
    whole = build_stage(CFG, 3, 0, seed=0)
    split = build_stage(CFG, 3, 0, seed=0)
    generator = torch.Generator().manual_seed(1)
    deferred = []
    for i in range(3):
        x = torch.randn(2, 16, CFG.d_model, generator=generator)
        targets = torch.randint(0, CFG.vocab_size, (2, 16), generator=generator)
        x_whole = x.clone().requires_grad_(True)
        loss = whole.loss(x_whole, targets)
        (loss * 0.25).backward()
        split_loss, x_grad, weight_grad = split.loss_and_input_grad(x, targets, loss_scale=0.25)
        assert split_loss == loss.item()
        assert torch.equal(x_grad, x_whole.grad)
        assert torch.equal(split.norm.weight.grad, whole.norm.weight.grad)
        if i == 0:
            assert split.lm_head.weight.grad is None  # nothing reaches the head's weight before its W pass
        deferred.append(weight_grad)
        if i >= 1:  # the first two W passes after the second B pass, the third at once
            for pending in deferred:
                pending.accumulate()
            deferred = []
    assert torch.equal(split.lm_head.weight.grad, whole.lm_head.weight.grad)
    assert split.embedding.weight.grad is None and x.grad is None


def test_a_block_stages_split_backward_adds_exactly_what_one_backward_would():
    """A stage worker passes B's input gradient upstream and runs the Linears' W passes later."""
    whole = build_stage(CFG, 3, 1, seed=0)
    split = build_stage(CFG, 3, 1, seed=0)
    generator = torch.Generator().manual_seed(2)
    later = []
    for _ in range(3):
        x = torch.randn(2, 16, CFG.d_model, generator=generator)
        grad = torch.randn(2, 16, CFG.d_model, generator=generator)
        x_whole = x.clone().requires_grad_(True)
        whole(x_whole).backward(grad)
        x_split = x.clone().requires_grad_(True)
        with recording_linears(split) as calls:
            y = split(x_split)
        x_grad, weight_grads = input_grad_first(split, x_split, y, grad, calls)
        assert len(calls) == 5 * len(split.blocks)  # qkv, out, gate, up, down
        assert torch.equal(x_grad, x_whole.grad)
        assert all(call.layer.weight.grad is None for call in calls)  # B leaves the Linears' weights alone
        later.append(weight_grads)
    for weight_grads in later:
        weight_grads.accumulate()
    for (name, p_whole), p_split in zip(whole.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(p_whole.grad, p_split.grad), name


SUBSPACE = ModelConfig(vocab_size=97, d_model=32, n_layers=5, n_heads=4, ffn_hidden=64, max_seq_len=16, subspace_rank=4)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_a_subspace_network_split_into_stages_is_the_one_process_model_and_sends_k_wide(stages):
    tokens, targets = _batch()
    whole = Llama(SUBSPACE, seed=7)
    head, blocks = build_all_stages(SUBSPACE, stages, seed=7)
    expected = whole(tokens, targets)
    assert torch.equal(forward_route(head, blocks, tokens, targets), expected)
    assert head.embed(tokens).shape == (3, 12, 4) and blocks[0](head.embed(tokens), tokens).shape == (3, 12, 4)
    assert sum(p.numel() for p in whole.parameters()) == SUBSPACE.params()
    with pytest.raises(ValueError, match="token ids"):
        blocks[0](head.embed(tokens))


def test_a_subspace_block_is_a_full_width_block_whose_output_projections_lie_in_the_subspace():
    """What crosses between stages loses nothing: a block that writes k coefficients computes the
    same residual stream as a d-wide block whose output projections are U·A (Protocol Models' form),
    fed the stream anchors[token] + c·Uᵀ."""
    tokens, _ = _batch(1)
    stage = build_stage(SUBSPACE, 2, 1, seed=3)
    full_cfg = ModelConfig(**{**SUBSPACE.__dict__, "subspace_rank": 0})
    full = build_stage(full_cfg, 2, 1, seed=3)
    basis, anchors = stage.subspace.basis, stage.subspace.anchors
    with torch.no_grad():
        for ours, theirs in zip(stage.blocks, full.blocks, strict=True):
            for name, param in theirs.named_parameters():
                mine = dict(ours.named_parameters())[name]
                param.copy_(basis @ mine if name in ("attn.out.weight", "mlp.down.weight") else mine)
    c = torch.randn(3, 12, SUBSPACE.subspace_rank)
    stream = torch.nn.functional.embedding(tokens, anchors) + c @ basis.T
    lifted = torch.nn.functional.embedding(tokens, anchors) + stage(c, tokens) @ basis.T
    torch.testing.assert_close(lifted, full(stream), rtol=1e-5, atol=1e-6)
