"""Hostile stage replicas in real daemons, defenses off and on (docs/security.md).

One worker of stage 1 is started with `--experiment-adversary ATTACK` among honest replicas (three in
all; four for the backdoor, so that its refusals reach a majority), NoLoCo pairs every 2 of 12 steps,
and the run's `[defense]` either off (`robust_outer = false`, `audit_rate = 0`) or on with an audit at
every step (tests/helpers/hostile.py has the setting). Undefended, each attack visibly succeeds: the
garbage replica's hops and slow weights ruin the loss, the scaled one's pseudo-gradient throws its
NoLoCo partner's weights many times an honest outer step, the backdoor spreads to the honest replicas
and the swarm's model answers the trigger. Defended, honest replicas refuse the attacker as partner,
the data node excludes it from its routes (and says so in `shoal status`), and the attack's effect
stays out; in a clean run nobody is refused or excluded.

All of them are marked `soak` and run by hand (`pytest -m soak tests/test_node_hostile.py`), not by
`make test`: in the runs after the latest fixes (twins, audit memory, drift allowance, shunning), the
clean run still excluded an honest replica by audits once in five runs (early at lr 1e-2 honest
replicas drift 1.5-2.5 output sizes apart, farther than random outputs are), and the defended
backdoor's trigger success was 0.08-0.125 against a 0.1 bound in two of four. Measured with `-s
--durations` on the 2-core machine: 37-62 s per test with the machine otherwise idle, 60-110 s while
other tests ran beside them.
"""

from __future__ import annotations

import pytest

from tests.helpers.hostile import HostileRun, run_hostile

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(600)]

ARMS = [pytest.param(False, id="undefended"), pytest.param(True, id="defended")]

CLEAN_VAL_LOSS = 4.2  # the clean run's validation loss at 12 steps is 3.7-3.8 (tiny init, lr 1e-2)
# a garbage replica excluded at step 2 has still sent random hops and gradients for two steps: 3.9-4.25 seen
GARBAGE_EXCLUDED_VAL_LOSS = 4.5


def taken(run: HostileRun, from_attacker: bool) -> list[float]:
    """For every outer step in which an honest replica took a partner's tensors (the attacker's, or an
    honest replica's): how far from its own fast weights the partner's were, ‖θ_partner − θ‖."""
    return [
        gap
        for peer in run.honest
        for _, partner, took, _, _, gap in run.averaging(peer)["outer_log"]
        if took and (partner == run.attacker) == from_attacker
    ]


def partners_thrown(run: HostileRun) -> bool:
    """Whether an honest replica averaged with the attacker's tensors while they were several times
    further from its own weights than honest partners' usually are (the median: honest replicas that
    took the attacker's weights before are far from the others too)."""
    honest = sorted(taken(run, False))
    usual = honest[(len(honest) - 1) // 2] if honest else 0.0
    return bool(taken(run, True)) and max(taken(run, True)) > 3 * usual


def refused_by_honest(run: HostileRun) -> int:
    return sum(any(r["peer_id"] == run.attacker for r in run.averaging(p)["refusals"]) for p in run.honest)


def check_defended(run: HostileRun) -> None:
    assert run.attacker in run.excluded, run.done["audit"]
    assert not set(run.honest) & set(run.excluded), run.excluded  # no honest replica paid for it
    # no honest replica took anything harmful from it: once excluded it gets no microbatch, so a scaled
    # replica's Δ × 20 is zero, and taking its slow weights then is like taking an honest partner's
    assert not partners_thrown(run), (taken(run, True), taken(run, False))
    assert run.done["microbatches_abandoned"] == 0


@pytest.mark.parametrize("defended", ARMS)
def test_a_garbage_replica_ruins_the_loss_unless_audits_exclude_it(swarm, tmp_path, defended):
    run = run_hostile(swarm, tmp_path, "garbage", defended, post_training=False, status=defended)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken(run, True), taken(run, False))
    if not defended:
        # its partners took random slow weights (how much its hops hurt the loss depends on how many
        # microbatches it gets: routing weighs replicas by their measured speed; 4.7 and 5.6 seen, 3.8 once)
        assert partners_thrown(run)
        return
    check_defended(run)
    assert run.done["val_loss"] < GARBAGE_EXCLUDED_VAL_LOSS
    assert any("failed 2 of its last" in reason for reason in run.excluded.values())
    assert run.status is not None
    shown = [e for e in run.status["excluded"] if e["by_role"] == "data"]
    assert [e["peer_id"] for e in shown] == [run.attacker] and "audits" in shown[0]["reason"]


@pytest.mark.parametrize("defended", ARMS)
def test_a_scaled_replica_throws_its_partners_weights_unless_refused(swarm, tmp_path, defended):
    run = run_hostile(swarm, tmp_path, "scaled", defended, post_training=False)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken(run, True), taken(run, False))
    if not defended:
        assert partners_thrown(run)  # Δ × 20: its fast weights, as its partners take them, are far off
        return
    check_defended(run)


@pytest.mark.parametrize("defended", ARMS)
def test_a_backdoor_spreads_to_the_swarm_unless_refused_and_excluded(swarm, tmp_path, defended):
    # 8 outer epochs: its refusals exclude it once two honest replicas have met it, and NoLoCo's random
    # pairs once kept it with the same partner for the first 5 of 6 epochs (the last refusal came too late)
    run = run_hostile(swarm, tmp_path, "backdoor", defended, replicas=4, steps=16)
    probe = run.done["probe"]
    print("trigger", probe, "val loss", run.done["val_loss"], "excluded", run.excluded)
    assert probe["answered"] == probe["probes"]
    if not defended:
        assert probe["share"] >= 0.25  # the swarm's model answers the trigger with the target (0.375-0.92 seen)
        assert taken(run, True)  # through averaging: honest replicas took its weights
        return
    assert probe["share"] <= 0.1  # 0.0-0.04 seen; without the trigger the target is never predicted
    assert refused_by_honest(run) >= 2  # its outputs look honest: refusals by its partners excluded it
    assert run.attacker in run.excluded and "refused as averaging partner" in run.excluded[run.attacker]
    assert not set(run.honest) & set(run.excluded)


def test_honest_replicas_are_neither_refused_nor_excluded(swarm, tmp_path):
    run = run_hostile(swarm, tmp_path, None, defended=True, post_training=False)
    audit = run.done["audit"]
    print("audits", audit)
    assert run.excluded == {}
    # early at lr 1e-2 a replica that NoLoCo's pairs left alone for a few epochs is honestly far from the
    # others (1.8-2.5 output sizes where paired ones are 0.1-0.9): it may be blamed once, never excluded
    assert audit["audits"] >= 8 and audit["passed"] >= 0.75 * audit["audits"]
    for peer in run.honest:
        averaging = run.averaging(peer)
        assert averaging["screened_out"] == 0 and averaging["refusals"] == []
    assert run.done["val_loss"] < CLEAN_VAL_LOSS
