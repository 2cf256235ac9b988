"""The outer optimizer: NoLoCo's group update (code signs), DiLoCo, the local step, wire checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.config import ConfigError
from shoal.protocol.errors import BadTensor
from shoal.train.outer import (
    OuterConfig,
    OuterState,
    check_partner_tensors,
    diloco_step,
    load_slow_weights,
    local_step,
    noloco_step,
    pseudo_gradient,
    replica_distance,
    replica_mean,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def random_replica(gen: torch.Generator, scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.randn(3, 4, generator=gen) * scale, torch.randn(5, generator=gen) * scale]


def test_noloco_pair_update_matches_a_hand_computed_example():
    # Dyadic numbers, so float32 is exact: m_i ← α·m_i + β·mean(Δ) + γ·(mean(φ) − φ_i); φ_i ← φ_i + m_i.
    config = OuterConfig.noloco(alpha=0.5, beta=0.75, gamma=0.25)
    mine = OuterState(phi=[t(1.0, 2.0)], momentum=[t(1.0, -2.0)], epoch=3)
    theirs = OuterState.from_tensors([t(3.0, 0.0)])
    my_delta, their_delta = [t(0.5, -1.0)], [t(1.5, 0.0)]

    new_mine = noloco_step(mine, my_delta, [theirs.phi], [their_delta], config)
    # mean Δ = (1, -0.5); mean φ = (2, 1); pull = (1, -1)
    # m = 0.5·(1, -2) + 0.75·(1, -0.5) + 0.25·(1, -1) = (1.5, -1.625); φ = (1, 2) + m
    assert torch.equal(new_mine.momentum[0], t(1.5, -1.625))
    assert torch.equal(new_mine.phi[0], t(2.5, 0.375))
    assert new_mine.epoch == 4
    assert torch.equal(mine.phi[0], t(1.0, 2.0)), "the old state is left untouched"

    new_theirs = noloco_step(theirs, their_delta, [mine.phi], [my_delta], config)
    # m = 0 + 0.75·(1, -0.5) + 0.25·((2, 1) − (3, 0)) = (0.5, -0.125)
    assert torch.equal(new_theirs.momentum[0], t(0.5, -0.125))
    assert torch.equal(new_theirs.phi[0], t(3.5, -0.125))


def test_default_noloco_config_matches_the_paper_and_the_update_adds_the_pseudo_gradient():
    config = OuterConfig.noloco()
    assert (config.mode, config.alpha, config.beta, config.gamma, config.group_size) == ("noloco", 0.5, 0.7, 0.7, 2)
    assert OuterConfig() == config
    state = OuterState.from_tensors([t(0.0)])
    # Both replicas moved by +1: the code's sign moves φ with Δ (the paper's −β would move it back).
    new = noloco_step(state, [t(1.0)], [[t(0.0)]], [[t(1.0)]], config)
    assert new.phi[0].item() == pytest.approx(0.7)


def test_noloco_with_the_whole_swarm_as_its_group_is_diloco():
    gen = torch.Generator().manual_seed(0)
    n_replicas, rounds = 4, 5
    noloco = OuterConfig.noloco(alpha=0.3, beta=0.7, gamma=0.7, group_size=n_replicas)
    diloco = OuterConfig.diloco()
    start = random_replica(gen)
    replicas = [OuterState.from_tensors(start) for _ in range(n_replicas)]
    reference = OuterState.from_tensors(start)
    for _ in range(rounds):
        # Replicas start equal and always average with everyone, so every φ stays equal and the pull is 0.
        deltas = [random_replica(gen, scale=0.1) for _ in range(n_replicas)]
        replicas = [
            noloco_step(
                state,
                deltas[i],
                [other.phi for j, other in enumerate(replicas) if j != i],
                [d for j, d in enumerate(deltas) if j != i],
                noloco,
            )
            for i, state in enumerate(replicas)
        ]
        reference = diloco_step(reference, replica_mean(deltas), diloco)
    for state in replicas:
        for got, want in zip([*state.phi, *state.momentum], [*reference.phi, *reference.momentum], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert replicas[0].epoch == reference.epoch == rounds


def test_local_step_is_the_group_of_one():
    gen = torch.Generator().manual_seed(1)
    config = OuterConfig.noloco()
    state = OuterState(phi=random_replica(gen), momentum=random_replica(gen))
    delta = random_replica(gen)
    new = local_step(state, delta, config)
    for p, m, d, new_p, new_m in zip(state.phi, state.momentum, delta, new.phi, new.momentum, strict=True):
        want_m = config.alpha * m + config.beta * d
        assert torch.equal(new_m, want_m)
        assert torch.equal(new_p, p + want_m)
    assert new.epoch == state.epoch + 1


def test_two_replicas_starting_apart_converge_under_pair_updates():
    gen = torch.Generator().manual_seed(2)
    config = OuterConfig.noloco()
    a, b = OuterState.from_tensors(random_replica(gen)), OuterState.from_tensors(random_replica(gen))
    zero = [torch.zeros_like(p) for p in a.phi]
    start = replica_distance(a.phi, b.phi)
    pair_mean = replica_mean([a.phi, b.phi])
    for _ in range(40):
        a, b = noloco_step(a, zero, [b.phi], [zero], config), noloco_step(b, zero, [a.phi], [zero], config)
    assert replica_distance(a.phi, b.phi) < 1e-4 * start
    # With Δ = 0 the pulls are equal and opposite: the pair's mean does not move.
    for got, want in zip(replica_mean([a.phi, b.phi]), pair_mean, strict=True):
        torch.testing.assert_close(got, want)


def test_bf16_partner_tensors_are_accepted_and_the_math_stays_float32():
    config = OuterConfig.noloco()
    state = OuterState.from_tensors([t(1.0, 2.0)])
    new = noloco_step(state, [t(0.5, 0.5)], [[t(3.0, 4.0).bfloat16()]], [[t(0.5, 0.5).bfloat16()]], config)
    assert new.phi[0].dtype == new.momentum[0].dtype == torch.float32
    want = OuterState.from_tensors([t(1.0, 2.0)])
    want = noloco_step(want, [t(0.5, 0.5)], [[t(3.0, 4.0)]], [[t(0.5, 0.5)]], config)
    assert torch.equal(new.phi[0], want.phi[0])


def test_module_round_trip_clones_and_writes_back():
    torch.manual_seed(3)
    module = nn.Linear(4, 3)
    state = OuterState.from_module(module)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # H inner steps, in short
    delta = pseudo_gradient(state, module)
    for d in delta:
        torch.testing.assert_close(d, torch.ones_like(d))
    new = local_step(state, delta, OuterConfig.noloco())
    load_slow_weights(module, new)
    for p, phi in zip(module.parameters(), new.phi, strict=True):
        assert torch.equal(p.detach(), phi)
        assert p.requires_grad
    assert not any(phi is p for phi, p in zip(state.phi, module.parameters(), strict=True))


def test_replica_distance_is_the_l2_norm_of_the_difference():
    assert replica_distance([t(0.0, 0.0), t(0.0)], [t(3.0, 0.0), t(4.0)]) == pytest.approx(5.0)
    assert replica_distance([t(1.0, 2.0)], [t(1.0, 2.0)]) == 0.0


@pytest.mark.parametrize(
    ("received", "match"),
    [
        ([t(1.0, 2.0)], "1 tensors, expected 2"),
        ([t(1.0, 2.0), t(1.0, 2.0)], r"tensor 1 has shape \(2,\), expected \(1,\)"),
        ([t(1.0, 2.0), t(1.0).reshape(1, 1)], r"tensor 1 has shape \(1, 1\)"),
        ([t(1.0, float("nan")), t(1.0)], "tensor 0 has NaN or Inf"),
        ([t(1.0, 2.0), t(float("inf"))], "tensor 1 has NaN or Inf"),
        ([torch.tensor([1, 2]), t(1.0)], "tensor 0 is torch.int64, expected a floating dtype"),
        ([t(1.0, 2.0), "x"], "item 1 is a str"),
    ],
)
def test_partner_tensors_are_refused_with_a_clear_error(received, match):
    ours = [t(0.0, 0.0), t(0.0)]
    with pytest.raises(BadTensor, match=f"partner phi: {match}"):
        check_partner_tensors(received, ours, "partner phi")


def test_partner_dtype_is_checked_when_asked():
    ours = [t(0.0, 0.0)]
    check_partner_tensors([t(1.0, 2.0).bfloat16()], ours, "phi")
    with pytest.raises(BadTensor, match="torch.bfloat16, expected torch.float32"):
        check_partner_tensors([t(1.0, 2.0).bfloat16()], ours, "phi", dtype=torch.float32)


def test_a_bad_partner_changes_nothing():
    state = OuterState.from_tensors([t(1.0, 2.0)])
    with pytest.raises(BadTensor, match="partner 0 pseudo-gradient"):
        noloco_step(state, [t(0.0, 0.0)], [[t(1.0, 2.0)]], [[t(float("nan"), 0.0)]], OuterConfig.noloco())
    with pytest.raises(BadTensor, match="partner 0 slow weights"):
        noloco_step(state, [t(0.0, 0.0)], [[t(1.0)]], [[t(0.0, 0.0)]], OuterConfig.noloco())
    with pytest.raises(BadTensor, match="averaged pseudo-gradient"):
        diloco_step(state, [t(float("inf"), 0.0)], OuterConfig.diloco())
    assert torch.equal(state.phi[0], t(1.0, 2.0))
    assert state.epoch == 0


def test_diloco_defaults():
    config = OuterConfig.diloco()
    assert (config.mode, config.alpha, config.beta, config.gamma, config.group_size) == ("diloco", 0.3, 0.7, 0.0, 0)
    assert config.inner_steps == 100


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"mode": "ddp"}, "outer.mode"),
        ({"alpha": 1.0}, "outer.alpha"),
        ({"alpha": -0.1}, "outer.alpha"),
        ({"beta": 0.0}, "outer.beta"),
        ({"beta": float("nan")}, "outer.beta"),
        ({"gamma": -1.0}, "outer.gamma"),
        ({"gamma": "0.7"}, "outer.gamma"),
        ({"group_size": 1}, "outer.group_size"),
        ({"group_size": True}, "outer.group_size"),
        ({"inner_steps": 0}, "outer.inner_steps"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as caught:
        OuterConfig.noloco(**overrides)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_diloco_config_refuses_noloco_only_knobs():
    with pytest.raises(ConfigError, match="outer.gamma: must be 0 in diloco mode"):
        OuterConfig.diloco(gamma=0.7)
    with pytest.raises(ConfigError, match="outer.group_size"):
        OuterConfig.diloco(group_size=2)


def test_noloco_pairs_are_mutual_cover_everyone_but_the_odd_one_and_change_with_the_epoch():
    from shoal.train.outer import noloco_partner

    replicas = [f"peer{i}" for i in range(5)]
    for epoch in range(4):
        partners = {me: noloco_partner("run", 1, epoch, replicas, me) for me in replicas}
        assert sum(p is None for p in partners.values()) == 1  # five replicas: two pairs and one alone
        assert all(partners[p] == me for me, p in partners.items() if p is not None)  # mutual
    draws = {tuple(sorted((m, p) for m, p in ((me, noloco_partner("run", 1, e, replicas, me)) for me in replicas) if p))
             for e in range(8)}  # fmt: skip
    assert len(draws) > 1  # redrawn every epoch
    assert noloco_partner("run", 1, 0, ["a"], "a") is None and noloco_partner("run", 1, 0, ["a", "b"], "c") is None


def test_an_epoch_ends_every_h_closed_steps_once():
    from shoal.train.outer import epoch_ended

    assert [epoch_ended(step, 10, 0) for step in (8, 9, 10, 19)] == [None, 1, None, 2]
    assert epoch_ended(9, 10, 1) is None  # already taken (a copy brought it)


@pytest.mark.parametrize(
    ("inner_step", "outer_epoch", "problem"),
    [
        (0, 0, None),
        (0, 1, None),  # an outer step may come before a pending inner one
        (25, 3, None),  # 25 steps at H = 10: epoch 2, one more allowed
        (100, 11, None),  # the run's last step
        (101, 0, "inner step 101 outside this run's 0..100"),
        (-1, 0, "inner step -1 outside this run's 0..100"),
        (2**63 - 1, 0, "inner step 9223372036854775807 outside this run's 0..100"),
        (25, 4, "outer epoch 4 outside 0..3, the most 25 inner steps reach"),
        (0, -1, "outer epoch -1 outside 0..1, the most 0 inner steps reach"),
        (0, 2**63 - 1, "outer epoch 9223372036854775807 outside 0..1, the most 0 inner steps reach"),
    ],
)
def test_a_copys_counters_are_taken_only_where_a_replica_of_the_run_can_stand(inner_step, outer_epoch, problem):
    from shoal.train.outer import counters_refusal

    assert counters_refusal(inner_step, outer_epoch, total_steps=100, inner_steps=10) == problem
