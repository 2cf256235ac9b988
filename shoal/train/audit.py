"""Audits of stage replicas: the same activation to several replicas of a stage, their outputs compared.

A data node cannot check a stage's output itself (it does not hold the stage), but replicas of one
stage hold nearly the same weights (they start identical and NoLoCo or DiLoCo keep pulling them
together), so given the same input their outputs agree up to the replicas' drift. A replica that
returns garbage or scaled activations stands out; one that runs weights moved away from the others'
(a backdoor blended in, papers/backdoor.md) only as far as its clean outputs moved. For each audited
replica i with output y_i of input x:

    deviation_i = min_j≠i ‖y_i − y_j‖ / u          distance to the nearest other replica's output, in
                                                   units of u, the lower median of the ‖y_j‖ (twins
                                                   left out, below)
    threshold   = max(k · median(passed deviations of this stage), min_spread)

(The unit is the output's size, not the stage's update ‖y − x‖: early in training a block adds little
to its residual input, and one honest step changes that little a lot. Random outputs of the right
size are √2 units from an honest one, outputs scaled by c are c − 1 units off.)

An audit passes when every deviation is within the threshold. With two replicas a failure cannot say
who is wrong: a third replica referees, and the replica far from a majority that agrees among itself
is blamed (`judge`); without one, nobody is (a stage of two replicas is not audited in effect: an
update-size rule was tried and blamed honest replicas early in training, when one step more changes a
block's output a lot). Replicas whose outputs are identical (twins: two that just took each other as
NoLoCo partners run the same weights) are one witness, not two: a twin's deviation is its distance to
the nearest replica that is not its twin, and an audit with fewer than three distinct outputs blames
nobody. (Counting twins twice blamed an honest third replica, left out of NoLoCo's pairs for a few
epochs, as far from a "majority" that was one pair of weights.) Only what passed teaches the spread,
so a hostile replica cannot widen it.
Pure: tensors and tuples in, verdicts and a new history out; the data node does the sending
(shoal/node/pipeline/data/auditor.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from shoal.device import float64


@dataclass(frozen=True)
class AuditConfig:
    """From the run's `[defense]` section (shoal.config.PipelineDefenseConfig)."""

    tolerance: float = 2.5  # k
    min_spread: float = 0.5  # a deviation below this always passes (before the spread is known, too)
    window: int = 32  # passed audits per stage that the median spread is taken over
    failures: int = 2  # blamed audits, among its last `memory` audits, before a replica is excluded
    memory: int = 3


@dataclass(frozen=True)
class StageSpread:
    """What a data node has seen of one stage's honest replicas in passed audits (most recent last)."""

    deviations: tuple[float, ...] = ()


TWIN_GAP = 1e-6  # outputs closer than this, in units of the output's size, come from the same weights


@dataclass(frozen=True)
class AuditMeasure:
    peers: tuple[str, ...]
    deviations: tuple[float, ...]  # per peer, see the module docstring
    witnesses: int  # distinct outputs (twins counted once)


@dataclass(frozen=True)
class AuditVerdict:
    passed: bool
    blamed: tuple[str, ...]  # replicas found wrong (empty when passed, or when nobody can be told apart)
    needs_referee: bool  # two replicas disagree: a third one would settle it
    threshold: float
    reason: str


def measure(x: torch.Tensor, outputs: Mapping[str, torch.Tensor]) -> AuditMeasure:
    """Deviations of two or more replicas' outputs for the same input `x` (B, T, C)."""
    if len(outputs) < 2:
        raise ValueError(f"an audit compares at least two replicas, got {len(outputs)}")
    peers = tuple(outputs)
    x64 = float64(x)
    ys = [float64(outputs[p]).to(x64.device) for p in peers]
    sizes = sorted(float(torch.linalg.vector_norm(y)) for y in ys)
    unit = max(sizes[(len(sizes) - 1) // 2], 1e-12 * float(torch.linalg.vector_norm(x64)), 1e-30)
    gaps = [[float(torch.linalg.vector_norm(a - b)) / unit for b in ys] for a in ys]
    twins = [[j != i and gaps[i][j] <= TWIN_GAP for j in range(len(ys))] for i in range(len(ys))]
    deviations = []
    for i in range(len(ys)):
        others = [gaps[i][j] for j in range(len(ys)) if j != i and not twins[i][j]]
        deviations.append(min(others) if others else 0.0)
    witnesses = sum(not any(twins[i][:i]) for i in range(len(ys)))  # the first of each group of twins
    return AuditMeasure(peers, tuple(deviations), witnesses)


def threshold(spread: StageSpread, config: AuditConfig) -> float:
    typical = statistics.median(spread.deviations) if spread.deviations else 0.0
    return max(config.tolerance * typical, config.min_spread)


def judge(result: AuditMeasure, spread: StageSpread, config: AuditConfig, referee_available: bool) -> AuditVerdict:
    """The verdict on one audit.

    Two replicas pass when their deviation is within the threshold; otherwise a referee is asked for
    if `referee_available`, else nobody is blamed (either may be the wrong one). With three or more, the
    majority closest to each other sets the scale: a replica is blamed when its deviation is k times
    the larger of that majority's own spread and the stage's usual, so honest drift that is larger
    than usual right now (early in training, just before an outer step) blames nobody; the audit
    passes when nobody is blamed."""
    typical = statistics.median(spread.deviations) if spread.deviations else 0.0
    limit = threshold(spread, config)
    worst = max(result.deviations)
    if all(d <= limit for d in result.deviations):  # NaN never is
        return AuditVerdict(True, (), False, limit, "")
    said = f"outputs {worst:.3g} apart (in units of the output's size)"
    n = len(result.peers)
    if n >= 3 and result.witnesses >= 3:
        core = sorted(result.deviations)[n // 2]  # the spread of the closest majority (NaN sorts anywhere)
        limit = max(config.tolerance * max(core, typical), config.min_spread)
        far = tuple(p for p, d in zip(result.peers, result.deviations, strict=True) if not d <= limit)
        if not far:  # (a majority is within k of its own spread, so `far` is always a minority)
            return AuditVerdict(True, (), False, limit, "")
        return AuditVerdict(False, far, False, limit, f"{said}, {limit:.3g} allowed by the other replicas")
    return AuditVerdict(False, (), referee_available, limit, f"{said}, {limit:.3g} allowed: who is wrong needs a third")


def learn(spread: StageSpread, result: AuditMeasure, verdict: AuditVerdict, config: AuditConfig) -> StageSpread:
    """The stage's spread after an audit: the deviation of a passed audit of two,
    or of the closest majority of three or more (blamed or not), enter it; nothing else does, and no
    deviation of zero."""
    if not verdict.passed and not verdict.blamed:
        return spread
    keep = [i for i, p in enumerate(result.peers) if p not in verdict.blamed]
    if result.witnesses >= 3:  # the closest majority only: a replica just within the limit stays out
        keep = sorted(keep, key=lambda i: result.deviations[i])[: len(result.peers) // 2 + 1]
    else:
        keep = keep[:1]  # two replicas: one distance
    # identical outputs (two replicas that just averaged together, or never stepped) say nothing of the spread
    deviations = [*spread.deviations, *(result.deviations[i] for i in keep if result.deviations[i] > 1e-9)]
    return StageSpread(tuple(deviations[-config.window :]))


def excluded(recent: Sequence[bool], config: AuditConfig) -> bool:
    """Whether a replica is out of this data node's routes for good: blamed (True) in `failures` of
    the last `memory` audits it took part in, `recent` oldest first. A hostile replica's outputs are
    off in nearly every audit; an honest one is off now and then (NoLoCo left it out of the pairs
    for a few epochs, early in training when one step moves a block a lot), and those odd blames
    must not add up over a long run."""
    return sum(recent[-config.memory :]) >= config.failures


def refused_by_partners(
    refusals: Mapping[str, Collection[str]], stage_of: Mapping[str, int], ignore: Collection[str] = ()
) -> dict[str, str]:
    """Replicas that other replicas of their stage refused as averaging partners (their robust outer
    step, shoal/train/robust.py), when at least two of the others did and they are a majority of the
    others: {peer: reason}. `refusals[w]` are the peers worker `w` lists as refused, `stage_of` the
    live workers' stages; accusers in `ignore` (already excluded) do not count. One hostile replica
    can accuse anyone, but cannot make two accusers; two replicas alone never exclude each other."""
    found = {}
    for peer, stage in stage_of.items():
        others = [w for w, s in stage_of.items() if s == stage and w != peer]
        accusers = [w for w in others if w not in ignore and peer in refusals.get(w, ())]
        if len(accusers) >= 2 and 2 * len(accusers) > len(others):
            found[peer] = f"refused as averaging partner by {len(accusers)} of the {len(others)} other replicas"
    return found
