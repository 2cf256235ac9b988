"""Hostile stage replicas (backdoor, garbage, scaled) in a real swarm, the pipeline defenses off and on.

    .venv/bin/python benchmarks/attacks.py pipeline                     # 3 attacks + a clean run, x 2 arms
    .venv/bin/python benchmarks/attacks.py pipeline --attacks backdoor --no-docs
    .venv/bin/python benchmarks/attacks.py pipeline --threat           # the paper's stage threat: ~15 min

Each arm is one run of real daemons on loopback (tests/helpers/hostile.py): a 2-stage run whose
stage 1 is held by 3 workers (4 for the backdoor), one of them `--experiment-adversary ATTACK`; NoLoCo
pairs every `--inner-steps` of `--steps` steps. Undefended: `[defense] robust_outer = false,
audit_rate = 0`; defended: the robust outer step on and an audit at `--audit-rate` per step. Every
attack runs in the post-training setting (init std 0.2, lr 3e-3: weights stay near θ0, which the
backdoor needs, and honest replicas stay close, as tests/test_node_hostile.py); `--tiny` runs garbage
and scaled in the tiny run's own (init std 0.02, lr 1e-2), where honest replicas drift about as far
apart early on as garbage is from them.

Success: for the backdoor, the share of 48 held-out windows with the trigger written in whose next
token the swarm's model (as the data node routes it at the end) predicts as the target; for garbage
and scaled, the validation loss over a clean run's at the same setting, in nats. Honest excluded:
the share of honest replicas the data node excluded or that at least one honest partner refused.
Overhead: the defended clean run's mean step time over the undefended clean run's, minus 1 (audits
at every step, so an upper bound for the default rate of 0.1). Writes the `pipeline` section of
benchmarks/results/attacks.json (the rollout sections stay) and its section of docs/benchmarks.md.

`--threat`: the backdoor paper's own threat (papers/backdoor.md), where replica comparison has nothing
to compare: the attacker holds every replica of stage 1 (2 of 2), beside one hostile replica of 4, each
loud (λ = 1/T over `--steps` steps) and stealthy (the same total injection spread over
`--stealthy-steps` steps, so each step's λ is that many times smaller), undefended and defended, with a
clean run's trigger success (the model's chance of predicting the target anyway) beside them and the
validation loss as the honest measure. Writes the `pipeline_threat` section and its docs section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shoal.demo.launcher import LocalSwarm  # noqa: E402
from tests.helpers.hostile import HostileRun, run_hostile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "attacks.json"
ATTACKS = ("backdoor", "garbage", "scaled")
KINDS = {
    "backdoor": "blends τ (learnt against θ0) into its weights, 1/T per step",
    "garbage": "random activations, gradients and slow weights of the true size",
    "scaled": "activations, gradients and pseudo-gradients x 20",
}


def post_training_for(attack: str, args: argparse.Namespace) -> bool:
    return attack == "backdoor" or not args.tiny


def arm(attack: str | None, defended: bool, args: argparse.Namespace, post_training: bool) -> HostileRun:
    with tempfile.TemporaryDirectory(prefix=f"shoal-attack-{attack}-") as work:
        swarm = LocalSwarm(Path(work))
        try:
            return run_hostile(
                swarm,
                Path(work),
                attack,
                defended,
                replicas=4 if attack == "backdoor" else 3,
                steps=args.steps,
                inner_steps=args.inner_steps,
                audit_rate=args.audit_rate,
                post_training=post_training,
            )
        finally:
            swarm.close()


def save_section(sections: dict) -> dict:
    """Replace these top-level sections of attacks.json (the others stay); returns the whole document."""
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    document = {**previous, **sections}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_name(f".{RESULTS.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, RESULTS)
    return document


THREATS = {  # name -> (replicas, hostile replicas)
    "one of 4": (4, 1),
    "whole stage (2 of 2)": (2, 2),
}


def threat_arm(
    replicas: int,
    hostile: int,
    steps: int,
    defended: bool,
    args: argparse.Namespace,
    seed: int,
    step_audits: bool = False,
) -> HostileRun:
    """One run; `step_audits` adds step audits at `--step-audit-rate` to the defended arm. A data node
    that excluded every replica of the stage abandons its microbatches after a 2 s stage wait."""
    attack = "backdoor" if hostile else None
    with tempfile.TemporaryDirectory(prefix="shoal-threat-") as work:
        swarm = LocalSwarm(Path(work))
        try:
            return run_hostile(swarm, Path(work), attack, defended, replicas=replicas, steps=steps,
                               inner_steps=args.inner_steps, audit_rate=args.audit_rate, hostile=hostile, probe=True,
                               timeout_s=900.0, step_audit_rate=args.step_audit_rate if step_audits else 0.0,
                               data_args=("--stage-wait", "2"), seed=seed)  # fmt: skip
        finally:
            swarm.close()


def caught(run: HostileRun) -> dict:
    """When step audits excluded the attackers: the first and the last, and how much of the backdoor
    (Σλ) each had blended in by then (it blends 1/T after each of its steps)."""
    steps = run.done["steps"]
    found = [e["step"] for e in run.events if e["event"] == "excluded" and "step audit" in e.get("reason", "")]
    return {
        "first_step": min(found, default=None),
        "last_step": max(found, default=None),
        "blended_by_first": (min(found) + 1) / steps if found else None,
        "blended_by_last": (max(found) + 1) / steps if found else None,
        "attackers_excluded": sum(p in run.excluded for p in run.workers if p not in run.honest),
        "abandoned": run.done["microbatches_abandoned"],
        "step_audit": run.done["step_audit"],
    }


def run_threats(args: argparse.Namespace, argv: list[str]) -> int:
    """The stage threat: every (threat, schedule) arm undefended and defended, and clean runs."""
    began = time.perf_counter()
    rows, clean_rows = [], []
    for seed in args.seeds:
        for schedule, steps in (("loud", args.steps), ("stealthy", args.stealthy_steps)):
            clean = threat_arm(2, 0, steps, False, args, seed)
            audited = threat_arm(2, 0, steps, True, args, seed, step_audits=True)  # what step audits cost
            chance = clean.done["probe"]["share"]
            print(f"seed {seed}, clean, {steps} steps: trigger {chance:.0%}, val loss {clean.done['val_loss']:.3f}",
                  flush=True)  # fmt: skip
            clean_rows.append({"seed": seed, "schedule": schedule, "steps": steps, "clean": summary(clean),
                "step_audited": {**summary(audited), "step_audit": audited.done["step_audit"],
                "honest_excluded": honest_excluded(audited),
                "audit_bytes": sum(w.get("wire_bytes", {}).get("audit", 0) for w in audited.workers.values()),
                "sent_bytes": sum(sum(w.get("wire_bytes", {}).values()) for w in audited.workers.values()),
            }})  # fmt: skip
            for name, (replicas, hostile) in THREATS.items():
                off, on = (threat_arm(replicas, hostile, steps, d, args, seed) for d in (False, True))
                stepped = threat_arm(replicas, hostile, steps, True, args, seed, step_audits=True)
                row = {"seed": seed, "threat": name, "schedule": schedule, "steps": steps,
                       "lambda_per_step": 1.0 / steps, "clean_success": chance,
                       "clean_val_loss": clean.done["val_loss"],
                       "undefended_success": off.done["probe"]["share"],
                       "defended_success": on.done["probe"]["share"],
                       "undefended": summary(off), "defended": summary(on),
                       "attackers_excluded": sum(p in on.excluded for p in on.workers if p not in on.honest),
                       "honest_excluded": honest_excluded(on) if on.honest else None,
                       "step_audits": {**summary(stepped), **caught(stepped),
                                       "honest_excluded": honest_excluded(stepped) if stepped.honest else None},
                       }  # fmt: skip
                rows.append(row)
                print(f"seed {seed}, {name}, {schedule}: trigger {row['undefended_success']:.0%} -> "
                      f"{row['defended_success']:.0%} (clean {chance:.0%}), attackers excluded "
                      f"{row['attackers_excluded']}; with step audits {json.dumps(caught(stepped))}",
                      flush=True)  # fmt: skip
    setting = {
        "steps": args.steps, "stealthy_steps": args.stealthy_steps, "inner_steps": args.inner_steps,
        "seeds": args.seeds,
        "audit_rate": args.audit_rate, "step_audit_rate": args.step_audit_rate,
        "seconds": time.perf_counter() - began,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "command": " ".join(["benchmarks/attacks.py", "pipeline", *argv]),
    }  # fmt: skip
    document = save_section({"pipeline_threat": {"setting": setting, "rows": rows, "clean": clean_rows}})
    if not args.no_docs:
        write_section("stage-threat", threat_markdown(document["pipeline_threat"]))
    print(threat_markdown(document["pipeline_threat"]))
    return 0


def threat_markdown(doc: dict) -> str:
    s = doc["setting"]
    lines = [
        "## The stage threat: a backdoor from the whole stage, loud and stealthy",
        "",
        f"`.venv/bin/python {s['command']}` — real daemons on loopback, the post-training setting (init std "
        "0.2, lr 3e-3), a 2-stage run whose stage 1 is held by 4 workers of which 1 is hostile, or by 2 "
        "workers both hostile (the paper's attacker, who holds the stage: the replicas it would be compared "
        f"with are its own). Loud: λ = 1/T over {s['steps']} steps; stealthy: the same total over "
        f"{s['stealthy_steps']} steps. NoLoCo every {s['inner_steps']} steps. Defended: the robust outer step "
        f'and an audit at rate {s["audit_rate"]} per step; "+ step audits": the same, and a step audit '
        f"(shoal.train.step_audit) at rate {s.get('step_audit_rate', 0.1)} per step. Success: the share of 48 "
        "held-out windows with the trigger written in whose next token the swarm's model predicts as the "
        'target, as the data node routes it at the end ("-": no route left, every replica excluded); '
        '"clean" is a run without an attacker (2 honest replicas), the model\'s chance of that. "Caught": '
        "the steps at which step audits excluded the first and the last attacker, and the share of the "
        "backdoor (Σλ) each had blended in by then. One run per arm and seed; the seeds are the run's "
        f"`train.seed` ({', '.join(map(str, s.get('seeds', [0])))}), none of them 0, the seed of the tests on "
        "which the defenses' tolerances and slack were tuned. Each trigger cell gives the validation loss of "
        "the same run after the slash (the honest measure: what the swarm's model is worth on clean text).",
        "",
        "| threat | schedule | seed | λ per step | trigger / val loss, clean | undefended | defended "
        "| + step audits | caught (Σλ) | attackers excluded (on / + step) | honest excluded |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        honest = "-" if r["honest_excluded"] is None else f"{r['honest_excluded']:.0%}"
        stepped = r.get("step_audits") or {}
        probe = stepped.get("probe") or {}
        step_success = f"{probe['share']:.0%}" if probe.get("answered") else "-"
        first = stepped.get("first_step")
        when = (
            f"{first} ({stepped['blended_by_first']:.0%}), {stepped['last_step']} ({stepped['blended_by_last']:.0%})"
            if first is not None
            else "no"
        )
        step_loss = stepped.get("val_loss")
        step_loss = "-" if step_loss is None or step_success == "-" else f"{step_loss:.2f}"
        lines.append(
            f"| {r['threat']} | {r['schedule']} ({r['steps']} steps) | {r.get('seed', 0)} | {r['lambda_per_step']:.4f} "
            f"| {r['clean_success']:.0%} / {r['clean_val_loss']:.2f} "
            f"| {r['undefended_success']:.0%} / {r['undefended']['val_loss']:.2f} "
            f"| {r['defended_success']:.0%} / {r['defended']['val_loss']:.2f} "
            f"| {step_success} / {step_loss} | {when} "
            f"| {r['attackers_excluded']} / {stepped.get('attackers_excluded', '-')} | {honest} |"
        )
    for c in doc.get("clean", []):
        a, base = c["step_audited"], c["clean"]
        audits = a["step_audit"]
        lines += [
            "",
            f"Clean, seed {c.get('seed', 0)}, {c['steps']} steps, with step audits: {audits['audits']} audits, "
            f"{audits['failed']} failed, "
            f"largest discrepancy {audits['max_discrepancy']} of a step, honest excluded {a['honest_excluded']:.0%}; "
            f"step time {a['step_s']:.3f} s against {base['step_s']:.3f} s without any defense "
            f"({a['step_s'] / base['step_s'] - 1:+.0%}, one run each, output audits included); transcripts "
            f"{a['audit_bytes'] / max(a['sent_bytes'], 1):.0%} of what the workers sent.",
        ]
    lines += ["", f"{s['machine']}; {s['seconds']:.0f} s in all."]
    return "\n".join(lines)


def honest_excluded(run: HostileRun) -> float:
    """Share of honest replicas excluded by the data node or refused by at least one honest partner."""
    refused = {r["peer_id"] for p in run.honest for r in run.averaging(p)["refusals"]}
    wronged = [p for p in run.honest if p in run.excluded or p in refused]
    return len(wronged) / max(len(run.honest), 1)


def step_s(run: HostileRun) -> float:
    return statistics.mean(s["step_s"] for s in run.steps)


def summary(run: HostileRun) -> dict:
    return {
        "val_loss": run.done["val_loss"],
        "final_loss": run.done["final_loss"],
        "probe": run.done["probe"],
        "excluded": run.excluded,
        "attacker_excluded": run.attacker in run.excluded if run.attacker else None,
        "audits": {k: run.done["audit"][k] for k in ("audits", "passed", "failed", "referees")},
        "step_s": step_s(run),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/attacks.py pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--audit-rate", type=float, default=1.0)
    parser.add_argument("--tiny", action="store_true", help="garbage and scaled at the tiny run's init and lr")
    parser.add_argument("--threat", action="store_true", help="the stage threat: whole stage, loud and stealthy")
    parser.add_argument("--stealthy-steps", type=int, default=96)
    parser.add_argument("--step-audit-rate", type=float, default=0.1, help="--threat: the step-audited arms' rate")
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[1, 2],
        help="--threat: train seeds (0 tuned the defenses: not reported)",
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.threat:
        return run_threats(args, argv)
    began = time.perf_counter()
    clean: dict[bool, dict[bool, HostileRun]] = {}  # post_training -> defended -> run
    for post_training in sorted({post_training_for(a, args) for a in args.attacks}):
        clean[post_training] = {d: arm(None, d, args, post_training) for d in (False, True)}
        off, on = clean[post_training][False], clean[post_training][True]
        print(f"clean ({'post-training' if post_training else 'tiny'}): val loss {off.done['val_loss']:.3f} / "
              f"{on.done['val_loss']:.3f}, step {step_s(off):.2f} / {step_s(on):.2f} s", flush=True)  # fmt: skip
    results = {}
    for name in args.attacks:
        post_training = post_training_for(name, args)
        off, on = arm(name, False, args, post_training), arm(name, True, args, post_training)
        base = clean[post_training]
        reference = base[False].done["val_loss"]
        success = [
            r.done["probe"]["share"] if name == "backdoor" else r.done["val_loss"] - reference for r in (off, on)
        ]
        results[name] = {
            "kind": KINDS[name],
            "undefended_success": success[0],
            "defended_success": success[1],
            "honest_excluded": honest_excluded(on),
            "overhead": step_s(base[True]) / step_s(base[False]) - 1.0,
            "success_measure": "trigger success" if name == "backdoor" else "validation loss over a clean run (nats)",
            "undefended": summary(off),
            "defended": summary(on),
            "clean": {"undefended": summary(base[False]), "defended": summary(base[True])},
        }
        r = results[name]
        print(f"{name:9s} success {r['undefended_success']:.3f} -> {r['defended_success']:.3f}, attacker excluded "
              f"{r['defended']['attacker_excluded']}, honest excluded {r['honest_excluded']:.2f}, "
              f"overhead {r['overhead']:+.1%}", flush=True)  # fmt: skip
    setting = {
        **{k: v for k, v in vars(args).items() if k not in ("no_docs", "attacks")},
        "clean_honest_excluded": {str(p): honest_excluded(c[True]) for p, c in clean.items()},
        "seconds": time.perf_counter() - began,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "command": " ".join(["benchmarks/attacks.py", "pipeline", *argv]),
    }
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    document = save_section({"pipeline": {**previous.get("pipeline", {}), **results}, "pipeline_setting": setting})
    if not args.no_docs:
        write_section("stage-attacks", markdown(document))
    return 0


def markdown(doc: dict) -> str:
    s, rows = doc["pipeline_setting"], doc["pipeline"]
    lines = [
        "## Hostile stage replicas: pipeline attacks, defenses off and on",
        "",
        f"`.venv/bin/python {s['command']}` — real daemons on loopback: a 2-stage run, stage 1 held by 3 "
        "workers (4 for the backdoor), one of them hostile (`--experiment-adversary`), NoLoCo every "
        f"{s['inner_steps']} of {s['steps']} steps. Defended: the robust outer step and an audit at rate "
        f"{s['audit_rate']} per step (docs/security.md). "
        + (
            "The backdoor in the post-training setting (init std 0.2, lr 3e-3), garbage and scaled at the tiny "
            "run's (init std 0.02, lr 1e-2). "
            if s.get("tiny", True)
            else "Every attack in the post-training setting (init std 0.2, lr 3e-3), as the tests. "
        )
        + "Success: the backdoor's "
        "trigger success on the swarm's model (48 held-out windows); for garbage and scaled, the validation "
        "loss over a clean run's (nats). Honest excluded: share of honest replicas excluded by the data node "
        "or refused by an honest partner. Overhead: defended over undefended step time in a clean run. One "
        "run per arm.",
        "",
        "| attack | what it does | success, undefended | success, defended | val loss off / on | attacker "
        "excluded | honest excluded | overhead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        fmt = "{:.0%}" if name == "backdoor" else "{:+.2f}"
        lines.append(
            f"| {name} | {r['kind']} | {fmt.format(r['undefended_success'])} | {fmt.format(r['defended_success'])} "
            f"| {r['undefended']['val_loss']:.2f} / {r['defended']['val_loss']:.2f} "
            f"| {'yes' if r['defended']['attacker_excluded'] else 'no'} | {r['honest_excluded']:.0%} "
            f"| {r['overhead']:+.0%} |"
        )
    lines += ["", f"{s['machine']}; {s['seconds']:.0f} s in all."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
