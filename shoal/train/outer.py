"""The outer optimizer of one stage replica: NoLoCo's group update, DiLoCo's, and the local fallback.

Every H inner steps a replica i turns its fast weights θ into a pseudo-gradient Δ = θ − φ against its
slow weights φ, and moves φ with heavy-ball momentum m:

    m_i ← α·m_i + β·mean_G(Δ_j) + γ·(mean_G(φ_j) − φ_i)      NoLoCo, G = i and its partners (n = 2)
    m   ← α·m   + β·mean_all(Δ_j)                            DiLoCo, the mean from an all-reduce
    φ_i ← φ_i + m_i;   θ_i ← φ_i

This is the update as the authors' code implements it (`SparseOptimizerC.outer_step`), not as the
paper prints it (papers/noloco.md, "Follow the code"): Δ = θ − φ already points the way the inner
optimizer descended, so it is *added* (the paper's "−β" is a sign slip); γ is its own knob (the code
uses γ = β = 0.7); and φ moves by m itself (heavy ball), not by a Nesterov look-ahead. A replica
whose partner did not answer in time takes a local outer step: the same formula with G = {i}, where
the pull term is zero. With G = every replica and all φ equal the pull vanishes too, which is DiLoCo.

Everything here is pure: tensors in, a new `OuterState` out; the daemon and the simulator do the
exchange. The daemon's side of one outer step:

    delta = pseudo_gradient(state, stage)                       # θ − φ, float32
    ... send state.phi and delta to the partner, receive theirs ...
    check_partner_tensors(their_phi, state.phi, "partner phi")   # or let noloco_step refuse them
    state = noloco_step(state, delta, [their_phi], [their_delta], config)   # or local_step(...)
    load_slow_weights(stage, state)                             # θ ← φ

The math runs in float32 whatever the wire carried (bf16 tensors are cast), and φ and m are kept in
float32 on the parameters' device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.config import ConfigError
from shoal.protocol.errors import BadTensor
from shoal.protocol.torch_tensors import all_finite

OUTER_MODES = ("noloco", "diloco")
Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class OuterConfig:
    """Outer-optimizer hyper-parameters; the defaults are NoLoCo's (papers/noloco.md, "Defaults").

    `OuterConfig.noloco()` and `OuterConfig.diloco()` give each method's defaults, with overrides.
    Invalid values raise `ConfigError` naming the field as `outer.<field>`.
    """

    mode: str = "noloco"  # "noloco" (random groups, no all-reduce) or "diloco" (all-reduce baseline)
    alpha: float = 0.5  # momentum; DiLoCo 0.3 (the authors found it beat the usual 0.9)
    beta: float = 0.7  # outer learning rate
    gamma: float = 0.7  # pull toward the group mean of φ; the paper gives no value, the code uses β
    group_size: int = 2  # n, replicas per NoLoCo group; 0 = every replica of the stage (DiLoCo)
    inner_steps: int = 50  # H, inner steps per outer step; DiLoCo 100

    @classmethod
    def noloco(cls, **overrides: Any) -> OuterConfig:
        return cls(**{"mode": "noloco", **overrides})

    @classmethod
    def diloco(cls, **overrides: Any) -> OuterConfig:
        defaults = {"mode": "diloco", "alpha": 0.3, "beta": 0.7, "gamma": 0.0, "group_size": 0, "inner_steps": 100}
        return cls(**{**defaults, **overrides})

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"outer.{name}", f"{message}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                need(isinstance(value, int | float) and not isinstance(value, bool), f.name, "must be a number")
                need(math.isfinite(value), f.name, "must be finite")
            elif f.type == "int":
                need(isinstance(value, int) and not isinstance(value, bool), f.name, "must be an integer")
        need(self.mode in OUTER_MODES, "mode", f"must be one of {', '.join(OUTER_MODES)}")
        need(0.0 <= self.alpha < 1.0, "alpha", "must be in [0, 1)")
        need(self.beta > 0.0, "beta", "must be positive")
        need(self.gamma >= 0.0, "gamma", "must be non-negative")
        need(self.inner_steps >= 1, "inner_steps", "must be at least 1")
        if self.mode == "noloco":
            need(self.group_size >= 2, "group_size", "must be at least 2 in noloco mode (1 is the local step)")
        else:
            need(self.gamma == 0.0, "gamma", "must be 0 in diloco mode (DiLoCo has no pull term)")
            need(self.group_size == 0, "group_size", "must be 0 (every replica) in diloco mode")


@dataclass(frozen=True, eq=False)
class OuterState:
    """One replica's slow weights φ and momentum m (float32, detached), and its outer steps so far."""

    phi: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]
    epoch: int = 0  # outer steps taken

    def __post_init__(self) -> None:
        object.__setattr__(self, "phi", tuple(self.phi))
        object.__setattr__(self, "momentum", tuple(self.momentum))
        _check_like(self.momentum, self.phi, "momentum")

    @classmethod
    def from_tensors(cls, tensors: Tensors) -> OuterState:
        """φ = float32 clones of `tensors` on their devices, m = 0."""
        phi = tuple(t.detach().to(torch.float32, copy=True) for t in tensors)
        return cls(phi=phi, momentum=tuple(torch.zeros_like(p) for p in phi))

    @classmethod
    def from_module(cls, module: nn.Module) -> OuterState:
        """φ = the module's parameters in `parameters()` order, as at the start of training."""
        return cls.from_tensors(list(module.parameters()))


def pseudo_gradient(state: OuterState, theta: nn.Module | Tensors) -> list[torch.Tensor]:
    """Δ = θ − φ in float32: where H inner steps moved the fast weights, the direction to add."""
    params = _tensors(theta)
    _check_like(params, state.phi, "fast weights")
    return [t.detach().to(torch.float32) - p for t, p in zip(params, state.phi, strict=True)]


def noloco_step(
    state: OuterState,
    delta: Tensors,
    partner_phis: Sequence[Tensors],
    partner_deltas: Sequence[Tensors],
    config: OuterConfig,
) -> OuterState:
    """The NoLoCo outer step of this replica over the group G = {this replica} ∪ partners.

    `partner_phis[k]` and `partner_deltas[k]` are partner k's φ and Δ as they arrived; they are checked
    (`check_partner_tensors`, any float dtype) before use, so a bad partner raises `BadTensor` and
    changes nothing. The group means put this replica first; for a pair, a + b == b + a in IEEE
    arithmetic, so both members compute the same means when φ crosses the wire in float32.
    `config.group_size` is for whoever forms the groups: any number of partners works here.
    """
    if len(partner_phis) != len(partner_deltas):
        raise ValueError(f"{len(partner_phis)} partner slow weights but {len(partner_deltas)} pseudo-gradients")
    _check_like(delta, state.phi, "own pseudo-gradient")
    for k, (their_phi, their_delta) in enumerate(zip(partner_phis, partner_deltas, strict=True)):
        check_partner_tensors(their_phi, state.phi, f"partner {k} slow weights")
        check_partner_tensors(their_delta, state.phi, f"partner {k} pseudo-gradient")
    mean_delta = replica_mean([delta, *partner_deltas])
    mean_phi = replica_mean([state.phi, *partner_phis])
    pull = [g - p for g, p in zip(mean_phi, state.phi, strict=True)]  # 0 for a group of one
    return _heavy_ball(state, mean_delta, pull, config.alpha, config.beta, config.gamma)


def local_step(state: OuterState, delta: Tensors, config: OuterConfig) -> OuterState:
    """The outer step when no partner answered in time: G = {i}, so m ← α·m + β·Δ and no pull.

    Never a wait on the swarm; in DiLoCo mode it is the step of a replica the all-reduce left out.
    """
    return noloco_step(state, delta, [], [], config)


def diloco_step(state: OuterState, mean_delta: Tensors, config: OuterConfig) -> OuterState:
    """The DiLoCo outer step: m ← α·m + β·mean_all(Δ); φ ← φ + m. `mean_delta` is what the all-reduce
    over every replica of the stage returned (checked like a partner's tensors); γ is not used."""
    check_partner_tensors(mean_delta, state.phi, "averaged pseudo-gradient")
    mean_delta = [d.to(p) for d, p in zip(mean_delta, state.phi, strict=True)]  # float32, on φ's device
    return _heavy_ball(state, mean_delta, None, config.alpha, config.beta, 0.0)


def epoch_ended(closed_step: int, inner_steps: int, taken: int) -> int | None:
    """The outer epoch that the close of data-node step `closed_step` ends (every `inner_steps`
    steps), if it is one after `taken`, the last epoch this replica has applied; else None."""
    epoch, rest = divmod(closed_step + 1, inner_steps)
    return epoch if rest == 0 and epoch > taken else None


def counters_refusal(inner_step: int, outer_epoch: int, total_steps: int, inner_steps: int) -> str | None:
    """Why a replica of a run of `total_steps` steps, whose outer epochs end every `inner_steps` inner
    steps, cannot stand at `inner_step` and `outer_epoch`, if it cannot. Its inner step is 0..the run's
    steps; the close that ends epoch e is that of step e·H - 1, after which it has taken e·H inner
    steps, so its epoch is at most inner_step // H (one more allowed: a repair takes its neighbours'
    largest of each, an outer step may come before a pending inner one)."""
    if not 0 <= inner_step <= total_steps:
        return f"inner step {inner_step} outside this run's 0..{total_steps}"
    most = inner_step // inner_steps + 1
    if not 0 <= outer_epoch <= most:
        return f"outer epoch {outer_epoch} outside 0..{most}, the most {inner_step} inner steps reach"
    return None


def noloco_partner(run_id: str, stage: int, epoch: int, replicas: Sequence[str], me: str) -> str | None:
    """My NoLoCo partner for `epoch` among the live `replicas` of a stage (me included), or None for
    the odd one out. As in the authors' code, a permutation seeded by the step pairs entry k with
    k + n/2; the seed here is (run, stage, epoch), so every replica with the same view draws the same
    pairs and no message is needed to agree on them."""
    if me not in replicas or len(replicas) < 2:
        return None
    seed = int.from_bytes(hashlib.sha256(f"{run_id}:{stage}:{epoch}".encode()).digest()[:8], "big")
    order = sorted(set(replicas))
    random.Random(seed).shuffle(order)
    half, k = len(order) // 2, order.index(me)
    if k < half:
        return order[k + half]
    return order[k - half] if k < 2 * half else None


def load_slow_weights(module: nn.Module, state: OuterState) -> None:
    """θ ← φ: the next inner phase starts from the slow weights (cast to each parameter's dtype).

    The inner optimizer's state (Adam moments) is left alone, as in the authors' code.
    """
    params = list(module.parameters())
    _check_like(params, state.phi, "module parameters")
    with torch.no_grad():
        for param, phi in zip(params, state.phi, strict=True):
            param.copy_(phi)


def replica_mean(replicas: Sequence[Tensors]) -> list[torch.Tensor]:
    """Elementwise float32 mean over replicas, tensor by tensor, summed in the order given."""
    if not replicas:
        raise ValueError("the mean of no replicas is undefined")
    first = replicas[0]
    means = []
    for k, ref in enumerate(first):
        total = ref.detach().to(torch.float32, copy=True)
        for other in replicas[1:]:
            total += other[k].to(device=total.device, dtype=torch.float32)
        means.append(total / len(replicas))
    return means


def replica_distance(a: Tensors, b: Tensors) -> float:
    """Absolute L2 distance ‖a − b‖ over all tensors together (not relative to ‖a‖), in float32.

    How far two replicas' weights have drifted apart; divide by a norm for a relative figure.
    """
    _check_like(b, a, "second replica")
    squares = 0.0
    for x, y in zip(a, b, strict=True):
        diff = x.detach().to(torch.float32) - y.detach().to(device=x.device, dtype=torch.float32)
        squares += float(torch.linalg.vector_norm(diff)) ** 2
    return math.sqrt(squares)


def check_partner_tensors(received: Tensors, ours: Tensors, what: str, *, dtype: torch.dtype | None = None) -> None:
    """Raise `BadTensor` unless `received` matches `ours` tensor for tensor: count, shape, dtype, finite.

    Nothing that arrives over the wire is trusted: a wrong shape would otherwise broadcast silently
    into the slow weights, a NaN would poison them for good. `dtype` is the dtype every received
    tensor must have (the run's wire dtype, or float32 after `frames_to_tensor`); None accepts any
    floating dtype, since the update casts to float32 anyway. `what` names the tensors in the error.
    """
    if not isinstance(received, Sequence) or isinstance(received, str | bytes):
        raise BadTensor(f"{what}: expected a list of tensors, got {type(received).__name__}")
    if len(received) != len(ours):
        raise BadTensor(f"{what}: {len(received)} tensors, expected {len(ours)}")
    for k, (got, want) in enumerate(zip(received, ours, strict=True)):
        if not isinstance(got, torch.Tensor):
            raise BadTensor(f"{what}: item {k} is a {type(got).__name__}, not a tensor")
        if tuple(got.shape) != tuple(want.shape):
            raise BadTensor(f"{what}: tensor {k} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if dtype is not None and got.dtype != dtype:
            raise BadTensor(f"{what}: tensor {k} is {got.dtype}, expected {dtype}")
        if not got.is_floating_point():
            raise BadTensor(f"{what}: tensor {k} is {got.dtype}, expected a floating dtype")
        if not all_finite(got):
            raise BadTensor(f"{what}: tensor {k} has NaN or Inf values")


def _heavy_ball(
    state: OuterState,
    mean_delta: Tensors,
    pull: Tensors | None,
    alpha: float,
    beta: float,
    gamma: float,
) -> OuterState:
    """m ← α·m + β·mean_delta (+ γ·pull); φ ← φ + m. Returns a new state; the old one is untouched."""
    phi, momentum = [], []
    for k, (p, m, d) in enumerate(zip(state.phi, state.momentum, mean_delta, strict=True)):
        new_m = alpha * m + beta * d
        if pull is not None:
            new_m = new_m + gamma * pull[k]
        phi.append(p + new_m)
        momentum.append(new_m)
    return OuterState(phi=tuple(phi), momentum=tuple(momentum), epoch=state.epoch + 1)


def _tensors(source: nn.Module | Tensors) -> list[torch.Tensor]:
    return list(source.parameters()) if isinstance(source, nn.Module) else list(source)


def _check_like(tensors: Tensors, reference: Tensors, what: str) -> None:
    """Same count and shapes as `reference`: our own tensors, so a mismatch is a bug, not a bad peer."""
    if len(tensors) != len(reference):
        raise ValueError(f"{what}: {len(tensors)} tensors, expected {len(reference)}")
    for k, (t, ref) in enumerate(zip(tensors, reference, strict=True)):
        if t.shape != ref.shape:
            raise ValueError(f"{what}: tensor {k} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
