"""Poisoned rollouts (Hail to the Thief): each attack against honest nodes, defenses off and on.

    .venv/bin/python benchmarks/attacks.py                       # 5 attacks x 2 arms, 30 rounds: ~15 min
    .venv/bin/python benchmarks/attacks.py --attacks length reward-lie --control   # rerun two, merged in
    .venv/bin/python benchmarks/attacks.py --attacks trigger --rounds 10 --no-docs   # a quick look
    .venv/bin/python benchmarks/attacks.py pipeline              # hostile stage replicas: stage_attacks.py

Nodes simulated in one process, task `add2r-steps` (2-digit addition with its working shown:
`47+38=15;08|58$`). Horizontal layout (every attack but the vertical trick): every round all nodes
derive the same 16 prompts; each honest node samples 4 completions per prompt (top-4 sampling) and
trains with `shoal.grpo.round.learn` (F-TIS) on its own, the other honest nodes' and the attacker's
completions. Vertical layout (the vertical trick, made for it): each node draws its own 16 prompts
and every node's completions form groups of their own. The attacker runs the same policy spec (so the
same-policy top-k check applies to it) and shares only what its attack forges; it does not train.
"Undefended" is `DefenseConfig(enabled=False)`, which also believes the bundles' claimed rewards (the
reward lie's vehicle). `--control` adds one arm per layout with no foreign completion at all
(`mode = "alone"`): the success each attack's measure shows from the policy's own drift.

Results merge per attack into benchmarks/results/attacks.json: a run replaces only the attacks it ran
(each entry keeps the command and setting that made it), and the table is rebuilt from all entries.

Per attack and arm: attack success (share of the honest nodes' fresh completions carrying the
payload, mean over the last quarter of rounds), honest held-out accuracy at the end (greedy, 128
prompts), the share of honest foreign completions the defenses rejected, and the defenses' cost
(seconds per node per round, and as a share of the round's learn time). Writes
benchmarks/results/attacks.json (section `rollouts`) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from docs_section import write_section

from shoal.adversary.attacks import ATTACKS
from shoal.grpo.defenses import DefenseConfig
from shoal.grpo.evaluate import accuracy, heldout_prompts
from shoal.grpo.policy import Policy, PolicySpec
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
from shoal.grpo.tasks import get_task, task_seed
from shoal.grpo.warmup import cached_warm_up
from shoal.model.corpus import cache_dir
from shoal.train.grpo import GRPOConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "attacks.json"
TASK = "add2r-steps"
SPEC = PolicySpec(task=TASK, d_model=48, n_layers=2, n_heads=2, warmup_steps=300, warmup_lr=3e-3)
LAYOUTS = {"vertical-trick": "vertical"}  # every other attack runs in the horizontal layout


def copy_policy(policy: Policy) -> Policy:
    fresh = Policy(policy.spec)
    fresh.load_state_dict(policy.state_dict())
    return fresh


def run_arm(
    start: Policy, attack_name: str, defended: bool, seed: int, args: argparse.Namespace, heldout, alone: bool = False
) -> dict:
    """`args.honest` honest nodes and one attacker, `args.rounds` rounds; returns the arm's measurements.

    With `alone`, the control: the same nodes train on their own completions only (`mode = "alone"`), so
    `success` holds every attack's measure of what the policy drifts into by itself (per attack name).
    """
    task, attack = get_task(TASK), ATTACKS[attack_name]
    layout = LAYOUTS.get(attack_name, "horizontal")
    cfg = RoundConfig(
        task=TASK,
        run_seed=seed,
        prompts_per_round=args.prompts,
        completions_per_prompt=args.group,
        lr=args.lr,
        sample_top_k=args.sample_top_k,
        grpo=GRPOConfig(mode="alone") if alone else GRPOConfig(),
        defense=DefenseConfig(enabled=defended, top_k=args.top_k),
    )
    # vertical: each node (the attacker last) draws its own prompts, as shoal.node.rollout.worker.prompts_of does
    seeds = [seed if layout == "horizontal" else task_seed(seed, "vertical", i) for i in range(args.honest + 1)]
    honest = [copy_policy(start) for _ in range(args.honest)]
    attacker = copy_policy(start)
    optimizers = [make_optimizer(p, cfg) for p in honest]
    generators = [torch.Generator().manual_seed(1000 * seed + i) for i in range(args.honest + 1)]
    tokenizer = SPEC.tokenizer()
    success: dict[str, list[float]] = {name: [] for name in ATTACKS}
    learn_s, defense_s, honest_seen, honest_rejected, attack_seen, attack_rejected = [], [], 0, 0, 0, 0
    for r in range(args.rounds):
        prompts = [round_prompts(dataclasses.replace(cfg, run_seed=s), r) for s in seeds]
        bundles = [make_bundle(p, cfg, prompts[i], g) for i, (p, g) in enumerate(zip(honest, generators, strict=False))]
        texts = [prompts[i][c.prompt_index].text for i, b in enumerate(bundles) for c in b.completions]
        outs = [tokenizer.decode(c.tokens) for b in bundles for c in b.completions]
        for name, a in ATTACKS.items():
            success[name].append(a.success(task, texts, outs))
        forgery = attack.forge(attacker, cfg, prompts[-1], generators[-1])
        for i, (policy, optimizer) in enumerate(zip(honest, optimizers, strict=True)):
            others = [j for j in range(args.honest) if j != i]
            foreign = [*(bundles[j] for j in others), forgery.bundle]
            theirs = None if layout == "horizontal" else [*(prompts[j] for j in others), prompts[-1]]
            began = time.perf_counter()
            report = learn(policy, optimizer, cfg, prompts[i], bundles[i], foreign, foreign_prompts=theirs)
            learn_s.append(time.perf_counter() - began)
            defense_s.append(report.defense_s)
            for n, rejected, _ in report.checks[:-1]:
                honest_seen, honest_rejected = honest_seen + n, honest_rejected + rejected
            attack_seen, attack_rejected = attack_seen + report.checks[-1][0], attack_rejected + report.checks[-1][1]
    tail = slice(len(success[attack_name]) - max(1, args.rounds // 4), None)
    return {
        "layout": layout,
        "success": statistics.mean(success[attack_name][tail]),
        "success_curve": [round(s, 4) for s in success[attack_name]],
        "success_by_attack": {name: statistics.mean(curve[tail]) for name, curve in success.items()},
        "accuracy": statistics.mean(accuracy(p, task, heldout) for p in honest),
        "honest_rejected": honest_rejected / max(honest_seen, 1),
        "attack_rejected": attack_rejected / max(attack_seen, 1),
        "defense_s_per_round": statistics.mean(defense_s),
        "learn_s_per_round": statistics.mean(learn_s),
    }


def main() -> int:
    if sys.argv[1:2] == ["pipeline"]:  # the pipeline attacks: real daemons, their own module
        from stage_attacks import main as pipeline_main

        return pipeline_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--honest", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt per node")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sample-top-k", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--control", action="store_true", help="add the alone arm per layout (the drift baseline)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, warm = cached_warm_up(SPEC, cache_dir() / "grpo")
    heldout = heldout_prompts(get_task(TASK), 0, 128)
    base = accuracy(start, get_task(TASK), heldout)
    print(f"policy {SPEC.model_id}: held-out accuracy after warm-up {base:.3f}", flush=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results: dict = dict(previous.get("rollouts", {}))
    for entry in results.values():  # entries from before the per-attack merge: the run-wide setting made them
        entry.setdefault("setting", previous.get("setting", {}))
    setting = {
        **{k: v for k, v in vars(args).items() if k not in ("no_docs", "attacks", "control")},
        "task": TASK,
        "policy": dataclasses.asdict(SPEC),
        "warmup_accuracy": base,
        "heldout_prompts": len(heldout),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": " ".join(["benchmarks/attacks.py", *sys.argv[1:]]),
    }
    began = time.perf_counter()
    controls = {}
    if args.control:  # one alone arm per layout: attack-independent but for the layout
        for layout in sorted({LAYOUTS.get(name, "horizontal") for name in args.attacks}):
            name = next(n for n in args.attacks if LAYOUTS.get(n, "horizontal") == layout)
            controls[layout] = run_arm(start, name, False, args.seed, args, heldout, alone=True)
            print(f"control ({layout}, mode alone): " + ", ".join(
                f"{a} {v:.3f}" for a, v in controls[layout]["success_by_attack"].items()), flush=True)  # fmt: skip
    for name in args.attacks:
        attack_began = time.perf_counter()
        arms = {
            arm: run_arm(start, name, arm == "defended", args.seed, args, heldout) for arm in ("undefended", "defended")
        }
        off, on = arms["undefended"], arms["defended"]
        results[name] = {
            "kind": ATTACKS[name].kind,
            "layout": off["layout"],
            "undefended_success": off["success"],
            "defended_success": on["success"],
            "honest_rejected": on["honest_rejected"],
            "overhead": on["defense_s_per_round"] / off["learn_s_per_round"],
            "defense_s_per_round": on["defense_s_per_round"],
            "attack_rejected": on["attack_rejected"],
            "undefended_accuracy": off["accuracy"],
            "defended_accuracy": on["accuracy"],
            "undefended_curve": off["success_curve"],
            "defended_curve": on["success_curve"],
            "setting": {**setting, "layout": off["layout"], "seconds": time.perf_counter() - attack_began},
        }
        if off["layout"] in controls:
            results[name]["alone_success"] = controls[off["layout"]]["success_by_attack"][name]
        print(
            f"{name:15s} success {off['success']:.3f} -> {on['success']:.3f}, accuracy {off['accuracy']:.3f} / "
            f"{on['accuracy']:.3f}, honest rejected {on['honest_rejected']:.4f}, attack rejected "
            f"{on['attack_rejected']:.3f}, defense {1000 * on['defense_s_per_round']:.1f} ms/round",
            flush=True,
        )
    # the control measures every attack; entries of earlier runs made in the same setting get it too
    same = ("rounds", "seed", "honest", "prompts", "group", "lr", "sample_top_k", "top_k")
    for name, entry in results.items():
        old = entry["setting"]
        layout = entry.get("layout", "horizontal")
        if name not in args.attacks and layout in controls and all(old.get(k) == setting[k] for k in same):
            entry["alone_success"] = controls[layout]["success_by_attack"][name]
            entry["alone_from"] = setting["command"]
    document = {"rollouts": results, "setting": {**setting, "seconds": time.perf_counter() - began}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_name(f".{RESULTS.name}.tmp")
    tmp.write_text(json.dumps({**previous, **document}, indent=1))
    os.replace(tmp, RESULTS)
    if not args.no_docs:
        write_section("rollouts", markdown({**previous, **document}))
    return 0


def markdown(doc: dict) -> str:
    s, rows = doc["setting"], doc["rollouts"]
    commands = sorted({r["setting"]["command"] for r in rows.values()})
    lines = [
        "## Poisoned rollouts: attacks against honest GRPO nodes, defenses off and on",
        "",
        f"`.venv/bin/python benchmarks/attacks.py` (rows made by {', '.join(f'`{c}`' for c in commands)}) — "
        f"{s['honest']} honest nodes and 1 attacker in one process, task `{s['task']}` (working shown), "
        f"{s['rounds']} rounds of {s['prompts']} prompts, {s['group']} completions per prompt per node "
        f"(top-{s['sample_top_k']} sampling), F-TIS, lr {s['lr']}; horizontal layout but for the vertical trick. "
        f"Same policy everywhere (d 48, 2 blocks, {s['policy']['warmup_steps']} warm-up steps: "
        f"{s['warmup_accuracy']:.0%} held-out accuracy to start). Defended: rewards recomputed (claimed rewards "
        f"ignored), same-policy top-{s['top_k']} check, rule-based step judge on every full-reward foreign "
        "completion, length-penalised reward (docs/security.md). Undefended: no check, claimed rewards believed. "
        "Success: share of the honest nodes' fresh completions carrying the payload, mean over the last quarter "
        'of rounds. Alone: the same measure with no foreign completion at all (`mode = "alone"`), the '
        'policy\'s own drift at this learning rate ("-": not measured). Rejected: share of honest foreign '
        "completions the checks refused. Overhead: the checks' time per node per round over the undefended learn "
        "step's. One seed.",
        "",
        "| attack | layout | what it sends | success, undefended | success, defended | alone | accuracy off / on "
        "| honest rejected | attack rejected | overhead |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        alone = f"{r['alone_success']:.1%}" if "alone_success" in r else "-"
        lines.append(
            f"| {name} | {r.get('layout', 'horizontal')} | {r['kind']} | {r['undefended_success']:.1%} "
            f"| {r['defended_success']:.1%} | {alone} "
            f"| {r['undefended_accuracy']:.1%} / {r['defended_accuracy']:.1%} | {r['honest_rejected']:.2%} "
            f"| {r['attack_rejected']:.0%} | {r['overhead']:.1%} ({1000 * r['defense_s_per_round']:.1f} ms) |"
        )
    lines += ["", f"{s['machine']}; the last run took {s['seconds']:.0f} s."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
