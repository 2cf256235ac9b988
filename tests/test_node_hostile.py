"""Hostile stage replicas in real daemons, defenses off and on (docs/security.md).

One worker of stage 1 is started with `--experiment-adversary ATTACK` among honest replicas (three in
all; four for the backdoor, so that its refusals reach a majority; two for the undefended scaled one),
NoLoCo pairs every 2 of 12 steps, and the run's `[defense]` either off (`robust_outer = false`,
`audit_rate = 0`) or on with an audit at every step (tests/helpers/hostile.py has the setting).
Undefended, each attack visibly succeeds: the garbage replica's hops and slow weights ruin the loss, the
scaled one's pseudo-gradient throws its NoLoCo partner's weights many times an honest outer step, the
backdoor spreads to the honest replicas and the swarm's model answers the trigger. Defended, honest
replicas refuse the attacker as partner, the data node excludes it from its routes (and says so in
`shoal status`), and the attack's effect stays out; in a clean run nobody is refused or excluded.

All run in the post-training setting (init std 0.2, lr 3e-3; tests/helpers/hostile.py): honest
replicas stay close there (audit spreads 0.06-0.63 output sizes, partners 0.2-0.9 apart), so garbage
(√2 output sizes off, slow weights √2‖θ‖ off) stands out. In the tiny run's own setting (init std
0.02, lr 1e-2) honest replicas drift 1.5-2.5 output sizes apart within a few steps, farther than
garbage is, and no tolerance separates them: these tests were `soak` while they ran there (a clean
run excluded an honest replica in one of five). Measured with `-s --durations` on the 2-core machine:
21-30 s each, 177 s for the seven (236 s while the odd one out of NoLoCo's pairs stalled each epoch).
"""

from __future__ import annotations

import pytest

from tests.helpers.hostile import HostileRun, run_hostile

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

ARMS = [pytest.param(False, id="undefended"), pytest.param(True, id="defended")]

# The post-training setting (tests/helpers/hostile.py): validation loss 6.28 at step 0
CLEAN_VAL_LOSS = 5.4  # a clean run's at 12 steps: 5.15
GARBAGE_EXCLUDED_VAL_LOSS = 5.5  # a garbage replica excluded at step 4 has sent random hops until then: 5.12
THROWN = 5.0  # "far further than an honest partner": this many times the largest honest pseudo-gradient


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
    """Whether an honest replica averaged with the attacker's tensors while they were far further from
    its own weights than an honest partner's can be. All replicas start from the same θ0 and each moves
    by its pseudo-gradients, so honest partners are within a few of them (0.3-0.9 apart, pseudo-gradients
    of 0.1-0.55, in clean runs); garbage slow weights are √2‖θ‖ away (about 39 here) and a scaled Δ × 20
    about 8. The yardstick is the honest replicas' largest pseudo-gradient, not their gaps to each other:
    once one of them has taken the attacker's weights, honest gaps grow too (12-16 seen)."""
    steps = [entry[3] for peer in run.honest for entry in run.averaging(peer)["outer_log"] if entry[3] > 0]
    return bool(steps) and any(gap > THROWN * max(steps) for gap in taken(run, True))


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
    run = run_hostile(swarm, tmp_path, "garbage", defended, status=defended)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken(run, True), taken(run, False))
    if not defended:
        # its partners took random slow weights (how much its hops hurt the loss depends on how many
        # microbatches it gets: routing weighs replicas by their measured speed; 4.7 and 5.6 seen, 3.8 once)
        assert partners_thrown(run)
        return
    check_defended(run)
    assert run.done["val_loss"] < GARBAGE_EXCLUDED_VAL_LOSS
    # Whichever defense gets there first: two failed audits, or both honest replicas of its stage refusing
    # it as an averaging partner (once, in a full-suite run: 1 failed audit by then, val loss 5.14).
    caught_by = ("failed 2 of its last", "refused as averaging partner")
    assert any(why in reason for reason in run.excluded.values() for why in caught_by), run.excluded
    assert run.status is not None
    shown = [e for e in run.status["excluded"] if e["by_role"] == "data"]
    assert [e["peer_id"] for e in shown] == [run.attacker], shown
    assert "audits" in shown[0]["reason"] or "averaging partner" in shown[0]["reason"], shown


@pytest.mark.parametrize("defended", ARMS)
def test_a_scaled_replica_throws_its_partners_weights_unless_refused(swarm, tmp_path, defended):
    # Undefended, its one honest partner meets it at every outer step, the first ones included, where
    # Δ × 20 throws farthest (4.3-10.3 against a yardstick of 2.5, four runs). Among three replicas
    # NoLoCo's random pairs once kept it apart from both until the late epochs, whose Δ is a tenth of the
    # first ones': the two it met then threw 1.2 and 2.0, within the yardstick
    run = run_hostile(swarm, tmp_path, "scaled", defended, replicas=3 if defended else 2)
    print("val loss", run.done["val_loss"], "audits", run.done["audit"], "taken", taken(run, True), taken(run, False))
    if not defended:
        assert partners_thrown(run)  # Δ × 20: its fast weights, as its partners take them, are far off
        return
    check_defended(run)


@pytest.mark.parametrize("defended", ARMS)
def test_a_backdoor_spreads_to_the_swarm_unless_refused_and_excluded(swarm, tmp_path, defended):
    # 8 outer epochs: its refusals exclude it once two honest replicas have met it, and NoLoCo's random
    # pairs once kept it with the same partner for the first 5 of 6 epochs (the last refusal came too late)
    # Undefended with one honest replica beside it, which then meets it at every outer step: among four,
    # NoLoCo's random pairs and the routes left the swarm's model clean in 1 of 8 runs (0.04), where the
    # other 7 read 0.48-0.79; with one honest replica, 0.96-1.0 in 11 of 12 runs and 0.375 once
    run = run_hostile(swarm, tmp_path, "backdoor", defended, replicas=4 if defended else 2, steps=16)
    probe = run.done["probe"]
    print("trigger", probe, "val loss", run.done["val_loss"], "excluded", run.excluded)
    assert probe["answered"] == probe["probes"]
    if not defended:
        assert probe["share"] >= 0.3  # the swarm's model answers the trigger with the target
        assert taken(run, True)  # through averaging: honest replicas took its weights
        return
    # 0.00 in 8 of 9 runs and 0.06 in one, against 0.375-0.94 undefended. What honest replicas take
    # stays in the swarm's model: its Δ is 0.7-19 M (what the epoch's AdamW steps can move), honest
    # ones 0.16-0.79 M, and its 0.71 M in one epoch was taken. 3 x a replica's own median Δ alone let
    # 1.1-1.9 M through in the first epochs (0.63 once in CI): 1.25 M is a ceiling now. Without the
    # trigger the target is never predicted
    assert probe["share"] <= 0.25
    assert not set(run.honest) & set(run.excluded)
    # every honest replica that met it carrying more than AdamW steps can move refused it. How often that
    # happens depends on its routes: weighed by a start-up speed test (298 against 435-926 blocks/s
    # once), it served 6 of 64 microbatches in one run, injected in 2 epochs, and met one honest
    # partner then; it is excluded once two have refused it (or by audits first, if its injections moved
    # its outputs: 0.63 output sizes where 0.5 were allowed, once)
    delta = {entry[0]: entry[3] for entry in run.averaging(run.attacker)["outer_log"]}
    met = [
        (epoch, took)
        for peer in run.honest
        for epoch, partner, took, *_ in run.averaging(peer)["outer_log"]
        if partner == run.attacker and delta[epoch] > run.step_ceiling(epoch)
    ]
    print("met with an injection over 1.25 M (epoch, taken):", met, "its deltas:", delta)
    assert met and not any(took for _, took in met), met
    if refused_by_honest(run) >= 2:
        reason = run.excluded.get(run.attacker, "")
        assert "refused as averaging partner" in reason or "failed 2 of its last" in reason, run.excluded


def test_honest_replicas_are_neither_refused_nor_excluded(swarm, tmp_path):
    run = run_hostile(swarm, tmp_path, None, defended=True, step_audit_rate=1.0)
    audit, step_audit = run.done["audit"], run.done["step_audit"]
    print("audits", audit, "step audits", step_audit)
    assert run.excluded == {}
    # every honest inner step replays exactly (the same code on the same CPU), and none is left unjudged
    assert step_audit["audits"] >= 8 and step_audit["failed"] == 0, step_audit
    assert step_audit["max_discrepancy"] <= 1e-5, step_audit
    # early at lr 1e-2 a replica that NoLoCo's pairs left alone for a few epochs is honestly far from the
    # others (1.8-2.5 output sizes where paired ones are 0.1-0.9): it may be blamed once, never excluded
    assert audit["audits"] >= 8 and audit["passed"] >= 0.75 * audit["audits"]
    for peer in run.honest:
        averaging = run.averaging(peer)
        assert averaging["screened_out"] == 0 and averaging["refusals"] == []
    assert run.done["val_loss"] < CLEAN_VAL_LOSS


def test_a_backdoor_held_by_the_whole_stage_is_caught_by_step_audits(swarm, tmp_path):
    """The paper's threat: the attacker holds every replica of the stage, so comparing replicas (output
    audits, the robust outer step) compares it with itself (benchmarks/attacks.py pipeline --threat:
    100 % trigger success with those on). A step audit replays one replica's inner step from its own
    transcript: the direction it blends in after each step is not what its gradients say. Each
    replica is excluded at the first audit that picks it; with none left, the data node's microbatches
    are abandoned with the reason, not lost."""
    run = run_hostile(
        swarm, tmp_path, "backdoor", True, replicas=2, hostile=2, steps=12, step_audit_rate=1.0,
        data_args=("--stage-wait", "2"),
    )  # fmt: skip
    step_audit = run.done["step_audit"]
    print("step audits", step_audit, "excluded", run.excluded)
    hostile = [peer for peer in run.workers if peer not in run.honest]
    assert set(run.excluded) == set(hostile), run.excluded
    assert all("step audit" in reason and "of a step away" in reason for reason in run.excluded.values())
    first = min(e["step"] for e in run.events if e["event"] == "excluded")
    assert first <= 2, run.events  # caught at once: its first blended step
    assert run.done["microbatches_abandoned"] > 0
    assert run.done["microbatches_completed"] + run.done["microbatches_abandoned"] == run.done["microbatches_injected"]
    details = run.done["abandoned_details"]
    assert any("is excluded from this node's routes" in str(d) for d in details), details
