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
"""

from __future__ import annotations

import pytest

from tests.helpers.hostile import HostileRun, run_hostile

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

CLEAN_VAL_LOSS = 4.1  # the clean run's validation loss at 12 steps is 3.7-3.8 (tiny init, lr 1e-2)


def taken_from_attacker(run: HostileRun) -> list[float]:
    """For every outer step in which an honest replica took the attacker's tensors: how far its slow
    weights moved, in units of its own pseudo-gradient (an honest pair step moves them about 1-2)."""
    return [
        phi_step / max(delta_norm, 1e-12)
        for peer in run.honest
        for _, partner, taken, delta_norm, phi_step in run.averaging(peer)["outer_log"]
        if partner == run.attacker and taken
    ]


def refused_by_honest(run: HostileRun) -> int:
    return sum(any(r["peer_id"] == run.attacker for r in run.averaging(p)["refusals"]) for p in run.honest)


def check_defended(run: HostileRun) -> None:
    assert run.attacker in run.excluded, run.done["audit"]
    assert not set(run.honest) & set(run.excluded), run.excluded  # no honest replica paid for it
    # no honest replica took what it sent: once excluded it gets no microbatch, so its Δ (× 20 or not) is
    # zero, and taking its slow weights then moves a partner no further than an honest pair step
    assert all(ratio < 3.0 for ratio in taken_from_attacker(run)), taken_from_attacker(run)
    assert run.done["microbatches_abandoned"] == 0


@pytest.mark.parametrize("defended", [False, True], ids=["undefended", "defended"])
def test_a_garbage_replica_ruins_the_loss_unless_audits_exclude_it(swarm, tmp_path, defended):
    run = run_hostile(swarm, tmp_path, "garbage", defended, post_training=False, status=defended)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken_from_attacker(run))
    if not defended:
        assert run.done["val_loss"] > CLEAN_VAL_LOSS
        assert max(taken_from_attacker(run)) > 5.0  # its partners took random slow weights
        return
    check_defended(run)
    assert run.done["val_loss"] < CLEAN_VAL_LOSS
    assert any("failed 2 audits" in reason for reason in run.excluded.values())
    assert run.status is not None
    shown = [e for e in run.status["excluded"] if e["by_role"] == "data"]
    assert [e["peer_id"] for e in shown] == [run.attacker] and "audits" in shown[0]["reason"]


@pytest.mark.parametrize("defended", [False, True], ids=["undefended", "defended"])
def test_a_scaled_replica_throws_its_partners_weights_unless_refused(swarm, tmp_path, defended):
    run = run_hostile(swarm, tmp_path, "scaled", defended, post_training=False)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken_from_attacker(run))
    if not defended:
        assert max(taken_from_attacker(run)) > 5.0  # Δ × 20: the partner's step is ~7 times its own Δ
        return
    check_defended(run)
    assert refused_by_honest(run) >= 1


@pytest.mark.parametrize("defended", [False, True], ids=["undefended", "defended"])
def test_a_backdoor_spreads_to_the_swarm_unless_refused_and_excluded(swarm, tmp_path, defended):
    run = run_hostile(swarm, tmp_path, "backdoor", defended, replicas=4)
    probe = run.done["probe"]
    print("trigger", probe, "val loss", run.done["val_loss"], "excluded", run.excluded)
    assert probe["answered"] == probe["probes"]
    if not defended:
        assert probe["share"] >= 0.5  # the swarm's model answers the trigger with the target (0.92 seen)
        assert taken_from_attacker(run)  # through averaging: honest replicas took its weights
        return
    assert probe["share"] <= 0.1  # 0.0 seen
    assert refused_by_honest(run) >= 2  # its outputs look honest: refusals by its partners excluded it
    assert run.attacker in run.excluded and "refused as averaging partner" in run.excluded[run.attacker]
    assert not set(run.honest) & set(run.excluded)


def test_honest_replicas_are_neither_refused_nor_excluded(swarm, tmp_path):
    run = run_hostile(swarm, tmp_path, None, defended=True, post_training=False)
    audit = run.done["audit"]
    print("audits", audit)
    assert run.excluded == {} and audit["blames"] == {}
    assert audit["audits"] >= 8 and audit["passed"] == audit["audits"]
    for peer in run.honest:
        averaging = run.averaging(peer)
        assert averaging["screened_out"] == 0 and averaging["refusals"] == []
    assert run.done["val_loss"] < CLEAN_VAL_LOSS
