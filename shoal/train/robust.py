"""The robust outer step: a stage replica's defense against partners whose pseudo-gradients are poisoned.

NoLoCo averages a replica with one partner every H inner steps, DiLoCo with the mean of all; a hostile
replica can send a pseudo-gradient Δ scaled twenty times, random weights, or fast weights θ = φ + Δ
that carry a backdoor (papers/backdoor.md). Before an outer step each replica screens what it
received against the distribution it has seen over its recent outer steps:

    s_Δ = median(‖Δ‖ of its own last steps, this one included)
    s_D = median(‖θ_partner − θ‖ of the partners it accepted)
    NoLoCo: refuse the partner (a local step instead) if ‖Δ_partner‖ > min(max(k·s_Δ, M), 1.25 M)
            or ‖θ_partner − θ‖ > max(2k·s_D, 2M)
            (before it took any partner: max(k·‖Δ_own‖, 2M, min(2A, ‖θ‖)))
            (before it took an inner step of its own, s_Δ unknown: ‖Δ_partner‖ > 1.25 M)
    DiLoCo: the mean cannot be refused per partner, so it is clipped toward our own Δ, as one
            CenteredClip iteration (Karimireddy et al., 2021) centred on ours: radius 2k·s_D

k is `defense.outer_tolerance` (3 by default). Honest replicas of a stage see similar data and the
same learning rate, and AdamW's steps have about the same size whatever the gradient, so their Δ
norms agree within tens of percent and their distances move slowly with the schedule; anything k
times the median is not honest drift. Distances get twice the slack: they also grow with the time
since two replicas last averaged, which NoLoCo's random pairs leave uneven (a replica left out of
pairs for a few epochs is far from the others, honestly). Zeros (an epoch without an inner step,
two replicas that just averaged together) say nothing about the spread and are left out of the
medians. M, the most the epoch's AdamW steps can move a replica (each weight by about the learning
rate per step: Σ_t lr_t·√(number of weights)), keeps a replica that took fewer steps than its partner
this epoch (it served fewer microbatches, or none) from refusing it; two replicas that left the same
slow weights are at most 2M apart. It is a ceiling as well: no honest Δ is much over M (AdamW's
normalised step is about 1 per weight at most), so one over 1.25 M is refused whatever our own
median allows. Honest Δs vary 2-3x within one epoch (replicas serve different numbers of
microbatches), so k·s_Δ of a replica that served many is wide: a backdoor replica's Δ of 1.1-1.2 (1.3-
2.3 M) passed 3 × 0.49 in a replica's first epochs, and the swarm's model ended answering its trigger.
A replica that never took a partner has no distances to go by, and NoLoCo's pairs leave one alone for
several epochs now and then (one of three always is): it drifted honestly from where the stage started,
and its first partner drifted about as much, so it takes one up to twice its own drift A away (the
moves of its slow weights in its local steps, plus ‖Δ_own‖; 4.4 apart after four epochs alone was
refused before this), but never one further than ‖θ‖, the size of its own weights: such a partner
shares nothing with it (random weights of the right size are √2·‖θ‖ off). A grows only with our own
measured moves, in every epoch without a partner taken, refusals included: an honest replica paired
with an attacker for five epochs, refusing it each time, drifted alone as far as one left out of the
pairs, and without its drift it refused the first honest partner it met (1.35 apart, 0.91 allowed). An
attacker gains little by being refused: its distance from the refusing replica grows at its own rate,
faster than the replica's drift (a backdoor's Δ was 5x an honest one). Once a partner was taken the
distances take over. The Δ scale comes from our own steps only, and only accepted partners' distances
enter the history, so an attacker cannot widen the window it is judged by (an accepted one would stay
in it for `window` steps). Pure: tensors and tuples in, a verdict and a new history out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.config import OptimConfig
from shoal.device import float64
from shoal.train.schedule import learning_rate

Tensors = Sequence[torch.Tensor]

# The most an honest partner's H AdamW steps can move it, in units of M: AdamW's normalised step
# m̂/√v̂ reaches about 1.16 at β = (0.9, 0.95), weight decay adds a little; honest Δs were 0.44-0.75 M
# in the tests' first epochs. A backdoor replica's Δ was 1.3-2.3 M. It is the whole yardstick for a
# replica that has not taken an inner step yet (no microbatch routed to it since it joined: no Δ of
# its own to judge by; one such replica took the backdoor's blind), and a ceiling for every other.
STEP_SLACK = 1.25


@dataclass(frozen=True)
class OuterHistory:
    """What one replica has seen of its stage over its last outer steps (most recent last)."""

    delta_norms: tuple[float, ...] = ()  # its own ‖Δ‖
    distances: tuple[float, ...] = ()  # ‖θ_partner − θ‖ of accepted partners (DiLoCo: ‖mean − Δ‖)
    alone: float = 0.0  # Σ ‖φ_new − φ‖ of its local steps since it last took a partner (A less ‖Δ_own‖)
    took_any: bool = False  # whether it ever took a partner


@dataclass(frozen=True)
class PartnerVerdict:
    accepted: bool
    reason: str  # why it was refused or clipped ("" if taken as it came)
    delta_norm: float  # the partner's ‖Δ‖ (DiLoCo: the mean's)
    distance: float  # ‖θ_partner − θ‖ (DiLoCo: ‖mean − Δ_own‖)
    delta_limit: float  # min(max(k·s_Δ, M), 1.25 M) (inf: no reference yet)
    distance_limit: float  # max(2k·s_D, 2M) (inf: no reference yet)


def norm(tensors: Tensors) -> float:
    """L2 norm over all tensors together, in float64 (no overflow for any finite float32 input)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(float64(t))) ** 2 for t in tensors))


def distance(a: Tensors, b: Tensors) -> float:
    """‖a − b‖ over all tensors together."""
    return norm([float64(x) - float64(y).to(float64(x).device) for x, y in zip(a, b, strict=True)])


def _limit(values: Sequence[float], tolerance: float) -> float:
    """k × the median of the positive `values`; inf while there is nothing to compare with."""
    positive = [v for v in values if v > 0]
    scale = statistics.median(positive) if positive else 0.0
    return tolerance * scale if scale > 0 and math.isfinite(scale) else math.inf


def screen_partner(
    phi: Tensors,
    delta: Tensors,
    their_phi: Tensors,
    their_delta: Tensors,
    history: OuterHistory,
    tolerance: float,
    step_bound: float = 0.0,
) -> PartnerVerdict:
    """Whether a NoLoCo partner's (φ, Δ) is within `tolerance` times the recent medians (see above);
    a ‖Δ‖ within `step_bound` (M), and a distance within 2M, always are; a ‖Δ‖ over 1.25 M never is.

    The tensors are assumed checked already (count, shape, finite: outer.check_partner_tensors)."""
    own_norm = norm(delta)
    their_norm = norm(their_delta)
    theta = [p + d for p, d in zip(phi, delta, strict=True)]
    their_theta = [p.to(t) + d.to(t) for p, d, t in zip(their_phi, their_delta, theta, strict=True)]
    gap = distance(their_theta, theta)
    own_scale = _limit((*history.delta_norms, own_norm), tolerance)
    ceiling = STEP_SLACK * step_bound if step_bound > 0 else math.inf  # what the epoch's steps can move
    delta_limit = min(max(own_scale, step_bound), ceiling)
    known = [d for d in history.distances if d > 0]
    if known or history.took_any:
        distance_limit = max(_limit(known, 2 * tolerance) if known else tolerance * own_norm, 2 * step_bound)
    else:
        drifted = min(2 * (history.alone + own_norm), norm(theta))
        distance_limit = max(tolerance * own_norm, 2 * step_bound, drifted)
    distance_limit = distance_limit if distance_limit > 0 else math.inf
    reasons = []
    if their_norm > delta_limit:
        capped = delta_limit == ceiling
        why = f"{STEP_SLACK:g}x what the epoch's steps can move" if capped else f"{tolerance:g}x the median"
        reasons.append(f"pseudo-gradient norm {their_norm:.4g} over {delta_limit:.4g} ({why})")
    if gap > distance_limit:
        reasons.append(f"distance {gap:.4g} over {distance_limit:.4g} ({2 * tolerance:g}x the median)")
    return PartnerVerdict(not reasons, "; ".join(reasons), their_norm, gap, delta_limit, distance_limit)


def adam_step_bound(learning_rates: Sequence[float], parameters: int) -> float:
    """M: about the most these AdamW steps can move weights, Σ lr_t·√(parameters) (each step moves each
    weight by about its learning rate at most, whatever the gradient)."""
    return sum(learning_rates) * math.sqrt(parameters)


def epoch_step_bound(optim: OptimConfig, total_steps: int, inner_steps: int, epoch: int, parameters: int) -> float:
    """M for outer epoch `epoch` (1-based): what its `inner_steps` AdamW steps at the run's schedule can move."""
    rates = [learning_rate(t, optim, total_steps) for t in range((epoch - 1) * inner_steps, epoch * inner_steps)]
    return adam_step_bound(rates, parameters)


def remember(
    history: OuterHistory, own_delta_norm: float, verdict: PartnerVerdict | None, window: int, moved: float = 0.0
) -> OuterHistory:
    """The history after one outer step: our own ‖Δ‖ always, the partner's distance only if accepted.
    `moved` is how far the step moved our slow weights: it adds to our drift alone (A) when no
    partner was taken."""
    distances = list(history.distances)
    took = verdict is not None and verdict.accepted
    if took:
        distances.append(verdict.distance)
    alone = 0.0 if took else history.alone + moved
    return OuterHistory(
        (*history.delta_norms, own_delta_norm)[-window:], tuple(distances[-window:]), alone, history.took_any or took
    )


def centered_clip(center: Tensors, value: Tensors, radius: float) -> list[torch.Tensor]:
    """One CenteredClip iteration with one point: `value` moved toward `center` until it is at most
    `radius` away (unchanged if it already is). Float32, on `center`'s devices."""
    gap = distance(value, center)
    keep = 1.0 if gap <= radius else radius / gap
    return [c.float() + keep * (v.to(c).float() - c.float()) for c, v in zip(center, value, strict=True)]


def screen_mean(
    delta: Tensors, mean_delta: Tensors, history: OuterHistory, tolerance: float
) -> tuple[list[torch.Tensor], PartnerVerdict]:
    """DiLoCo: the all-reduced mean Δ, clipped toward our own Δ to radius 2k·s_D (see above), and the
    verdict (accepted: it needed no clipping). A mean within the radius enters the history as is."""
    own_norm = norm(delta)
    gap = distance(mean_delta, delta)
    radius = _limit([d for d in history.distances if d > 0] or (own_norm,), 2 * tolerance)
    mean_norm = norm(mean_delta)
    if gap <= radius:
        return [m.to(d).float() for m, d in zip(mean_delta, delta, strict=True)], PartnerVerdict(
            True, "", mean_norm, gap, math.inf, radius
        )
    reason = f"mean {gap:.4g} from ours, clipped to {radius:.4g} ({2 * tolerance:g}x the median)"
    return centered_clip(delta, mean_delta, radius), PartnerVerdict(False, reason, mean_norm, gap, math.inf, radius)
