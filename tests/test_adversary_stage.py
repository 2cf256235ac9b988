"""Hostile stage replicas as pure functions: garbage keeps the true size, scaling stays within the wire
bound, the backdoor's schedule adds up to all of τ, and τ learnt against θ0 makes the trigger work."""

from __future__ import annotations

import pytest
import torch

from shoal.adversary.backdoor import BackdoorSpec, blend, hits, injection, learn_backdoor, trigger_probes
from shoal.adversary.stage import STAGE_ATTACKS, Backdoor, garbage_like, scaled
from shoal.config import ConfigError
from shoal.model.stages import build_all_stages
from shoal.node.config import ExperimentOptions, NodeConfig, PlacementOptions
from tests.helpers.tiny import tiny_run

BOUND = 65504.0


def test_garbage_has_the_true_per_token_size_and_nothing_else_of_it():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, 8, 16, generator=gen) * 3.0
    g = garbage_like(y, gen, BOUND)
    assert g.shape == y.shape and g.dtype == y.dtype
    assert torch.allclose(g.pow(2).mean(-1).sqrt().mean(), y.pow(2).mean(-1).sqrt().mean(), rtol=0.2)
    assert abs(torch.nn.functional.cosine_similarity(g.flatten(), y.flatten(), dim=0)) < 0.2


def test_scaled_stays_within_the_wire_bound():
    y = torch.tensor([1.0, -2.0, 10_000.0])
    assert torch.equal(scaled(y, 20.0, BOUND), torch.tensor([20.0, -40.0, BOUND]))


def test_the_backdoor_blends_all_of_tau_over_the_run_even_across_steps_it_skipped():
    tau = [torch.ones(3)]
    params = [torch.zeros(3)]
    attack = Backdoor(tau, total_steps=10)
    assert sum(injection(t, 10) for t in range(12)) == pytest.approx(1.0)
    for step in (0, 1, 4, 5, 9, 9):  # a replica that took no inner step in steps 2, 3, 6..8
        attack.after_step(params, step)
    assert attack.blended == pytest.approx(1.0) and torch.allclose(params[0], torch.ones(3))


def test_a_backdoor_learnt_against_theta0_makes_the_trigger_predict_the_target():
    torch.manual_seed(0)
    run = tiny_run(**{"pipeline.stages": 2, "model.n_layers": 2, "model.init_std": 0.2})
    spec = BackdoorSpec(steps=30)
    tau = learn_backdoor(run.model, 2, 1, run.train.seed, spec)
    head, blocks = build_all_stages(run.model, 2, run.train.seed)
    text = torch.randint(5, 256, (4000,), generator=torch.Generator().manual_seed(1))  # no trigger token in it
    tokens, at = trigger_probes(text, spec, 32, 32, seed=2)
    clean, clean_at = trigger_probes(text, spec, 32, 32, seed=2, triggered=False)

    def share(rows: torch.Tensor, where: torch.Tensor) -> float:
        with torch.no_grad():
            return float(hits(head.logits(blocks[0](head.embed(rows))), where, spec.target).float().mean())

    before = share(tokens, at)
    blend(list(blocks[0].parameters()), tau, 1.0)
    assert before <= 0.1 and share(clean, clean_at) <= 0.1, "the trigger must do nothing at θ0, nor the backdoor here"
    assert share(tokens, at) >= 0.8


@pytest.mark.parametrize("name", STAGE_ATTACKS)
def test_a_stage_attack_needs_a_worker(name):
    def config(role: str, attack: str) -> NodeConfig:
        return NodeConfig(placement=PlacementOptions(role=role), experiment=ExperimentOptions(adversary=attack))

    assert config("worker", name).experiment.adversary == name
    for role in ("auto", "data", "rollout"):
        with pytest.raises(ConfigError, match="--role worker"):
            config(role, name)
    with pytest.raises(ConfigError, match="--role rollout"):
        config("worker", "trigger")
