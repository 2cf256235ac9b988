"""Poisoned rollouts (Hail to the Thief): each attack against honest nodes, each defense alone and all
together, over several seeds, with the honest nodes' held-out accuracy beside attack success.

    .venv/bin/python benchmarks/attacks.py                          # 5 attacks x 6 arms + 2 clean arms, 3 seeds
    .venv/bin/python benchmarks/attacks.py --attacks trigger --arms none all --seeds 100 --no-docs  # a look
    .venv/bin/python benchmarks/attacks.py pipeline                 # hostile stage replicas: stage_attacks.py
    .venv/bin/python benchmarks/attacks.py pipeline --threat        # the paper's stage threat (backdoor)

Nodes simulated in one process per arm, task `add2r-steps` (2-digit addition with its working shown:
`47+38=15;08|58$`). Horizontal layout (every attack but the vertical trick): every round all nodes
derive the same prompts; each honest node samples its completions per prompt (top-4 sampling) and
trains with `shoal.grpo.round.learn` (F-TIS) on its own, the other honest nodes' and the attacker's
completions. Vertical layout (the vertical trick, made for it): each node draws its own prompts and
every node's completions form groups of their own. The attacker runs the same policy spec (so the
same-policy top-k check applies to it) and shares only what its attack forges; it does not train.

Arms (`ARMS`): `none` checks nothing and believes the bundles' claimed rewards (the reward lie's
vehicle); every other arm recomputes rewards itself, and adds: nothing (`rewards`), the top-k check
alone (`top-k`), the claim judge alone (`judge`), the length rule alone (`length`), or all of
them (`all`, the default of a run). `clean` rows have no attacker: the honest nodes exchange among
themselves, undefended and defended, which is what the defended arms' accuracy is held to.

Per attack, arm and seed: attack success (share of the honest nodes' fresh completions carrying the
payload, mean over the last quarter of rounds), honest held-out accuracy at the end (greedy, 128
prompts), the share of honest foreign completions the checks rejected, and their time. The setting
(learning rate, rounds, top-k, length excess) is tuned on seeds 100-102 (`--seeds 100 101 102` writes
the `tuning` section and no docs); the reported seeds are 0-2, kept apart from tuning.
Writes benchmarks/results/attacks.json (section `ablation`) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from docs_section import wall_time, write_section

from shoal.adversary.attacks import ATTACKS
from shoal.grpo.defenses import DefenseConfig, LengthMemory
from shoal.grpo.evaluate import accuracy, heldout_prompts
from shoal.grpo.loss import GRPOConfig
from shoal.grpo.policy import Policy, PolicySpec
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
from shoal.grpo.tasks import get_task, task_seed
from shoal.grpo.warmup import cached_warm_up
from shoal.model.corpus import cache_dir

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "attacks.json"
TASK = "add2r-steps"
SPEC = PolicySpec(task=TASK, d_model=48, n_layers=2, n_heads=2, warmup_steps=300, warmup_lr=3e-3)
LAYOUTS = {"vertical-trick": "vertical"}  # every other attack runs in the horizontal layout
CLEAN = "clean"  # the rows without an attacker
ARMS = ("none", "rewards", "top-k", "judge", "length", "all")
CLEAN_ARMS = ("none", "all")
TUNING_SEEDS = (100, 101, 102)


def defense_of(arm: str, args: argparse.Namespace) -> DefenseConfig:
    """The checks an arm runs: one alone, all, or none (`none` also believes claimed rewards)."""
    if arm == "none":
        return DefenseConfig(enabled=False)
    alone = DefenseConfig(top_k=0, judge="none", length_rule=False, length_excess=args.length_excess)
    return {
        "rewards": alone,
        "top-k": dataclasses.replace(alone, top_k=args.top_k),
        "judge": dataclasses.replace(alone, judge="claims"),
        "length": dataclasses.replace(alone, length_rule=True),
        "all": DefenseConfig(top_k=args.top_k, length_excess=args.length_excess),
    }[arm]


def copy_policy(policy: Policy) -> Policy:
    fresh = Policy(policy.spec)
    fresh.load_state_dict(policy.state_dict())
    return fresh


def run_arm(attack_name: str, arm: str, seed: int, args: argparse.Namespace) -> dict:
    """`args.honest` honest nodes and, but in the clean rows, one attacker, `args.rounds` rounds."""
    torch.set_num_threads(1)
    start, _ = cached_warm_up(SPEC, cache_dir() / "grpo")
    task = get_task(TASK)
    heldout = heldout_prompts(task, 0, 128)
    attacker_on = attack_name != CLEAN
    layout = LAYOUTS.get(attack_name, "horizontal")
    cfg = RoundConfig(
        task=TASK,
        run_seed=seed,
        prompts_per_round=args.prompts,
        completions_per_prompt=args.group,
        lr=args.lr,
        sample_top_k=args.sample_top_k,
        grpo=GRPOConfig(kl_coef=args.kl_coef),
        defense=defense_of(arm, args),
    )
    # vertical: each node (the attacker last) draws its own prompts, as shoal.node.rollout.worker.prompts_of does
    seeds = [seed if layout == "horizontal" else task_seed(seed, "vertical", i) for i in range(args.honest + 1)]
    honest = [copy_policy(start) for _ in range(args.honest)]
    attacker, reference = copy_policy(start), copy_policy(start) if args.kl_coef > 0 else None
    optimizers = [make_optimizer(p, cfg) for p in honest]
    memories = [LengthMemory(cfg.defense.length_memory) for _ in honest]
    generators = [torch.Generator().manual_seed(1000 * seed + i) for i in range(args.honest + 1)]
    tokenizer = SPEC.tokenizer()
    success: dict[str, list[float]] = {name: [] for name in ATTACKS}
    defense_s, honest_seen, honest_rejected, attack_seen, attack_rejected = [], 0, 0, 0, 0
    for r in range(args.rounds):
        prompts = [round_prompts(dataclasses.replace(cfg, run_seed=s), r) for s in seeds]
        bundles = [make_bundle(p, cfg, prompts[i], g) for i, (p, g) in enumerate(zip(honest, generators, strict=False))]
        texts = [prompts[i][c.prompt_index].text for i, b in enumerate(bundles) for c in b.completions]
        outs = [tokenizer.decode(c.tokens) for b in bundles for c in b.completions]
        for name, a in ATTACKS.items():
            success[name].append(a.success(task, texts, outs))
        forged = [ATTACKS[attack_name].forge(attacker, cfg, prompts[-1], generators[-1]).bundle] if attacker_on else []
        for i, (policy, optimizer) in enumerate(zip(honest, optimizers, strict=True)):
            others = [j for j in range(args.honest) if j != i]
            foreign = [*(bundles[j] for j in others), *forged]
            theirs = None if layout == "horizontal" else [*(prompts[j] for j in others), prompts[-1]][: len(foreign)]
            report = learn(policy, optimizer, cfg, prompts[i], bundles[i], foreign, reference, theirs, memories[i])
            defense_s.append(report.defense_s)
            for n, rejected, _ in report.checks[: len(others)]:
                honest_seen, honest_rejected = honest_seen + n, honest_rejected + rejected
            if attacker_on:
                attack_seen, attack_rejected = (
                    attack_seen + report.checks[-1][0],
                    attack_rejected + report.checks[-1][1],
                )
    tail = slice(args.rounds - max(1, args.rounds // 4), None)
    return {
        "attack": attack_name,
        "arm": arm,
        "seed": seed,
        "layout": layout,
        "success": statistics.mean(success[attack_name][tail]) if attacker_on else None,
        "success_by_attack": {name: statistics.mean(curve[tail]) for name, curve in success.items()},
        "accuracy": statistics.mean(accuracy(p, task, heldout) for p in honest),
        "honest_rejected": honest_rejected / max(honest_seen, 1),
        "attack_rejected": attack_rejected / max(attack_seen, 1) if attacker_on else None,
        "defense_s_per_round": statistics.mean(defense_s),
    }


def summarise(runs: list[dict]) -> dict:
    """Mean and range over seeds of each measure of one (attack, arm)."""

    def spread(key: str) -> dict | None:
        values = [r[key] for r in runs if r[key] is not None]
        if not values:
            return None
        return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}

    return {
        "seeds": [r["seed"] for r in runs],
        "layout": runs[0]["layout"],
        **{k: spread(k) for k in ("success", "accuracy", "honest_rejected", "attack_rejected", "defense_s_per_round")},
        "success_by_attack": {
            name: statistics.mean(r["success_by_attack"][name] for r in runs) for name in runs[0]["success_by_attack"]
        },
        "runs": runs,
    }


def main() -> int:
    if sys.argv[1:2] == ["pipeline"]:  # the pipeline attacks: real daemons, their own module
        from stage_attacks import main as pipeline_main

        return pipeline_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", default=[CLEAN, *ATTACKS], choices=[CLEAN, *ATTACKS])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--honest", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt per node")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--sample-top-k", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--length-excess", type=float, default=0.25)
    parser.add_argument("--jobs", type=int, default=2, help="arms run at once, one torch thread each")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start, _ = cached_warm_up(SPEC, cache_dir() / "grpo")  # once here, so the workers only load it
    base = accuracy(start, get_task(TASK), heldout_prompts(get_task(TASK), 0, 128))
    print(f"policy {SPEC.model_id}: held-out accuracy after warm-up {base:.3f}", flush=True)
    tuning = sorted(set(args.seeds) & set(TUNING_SEEDS))
    if tuning and len(tuning) != len(args.seeds):
        parser.error("tuning seeds (100-102) and reported seeds must not be mixed in one run")
    jobs = [
        (attack, arm, seed)
        for attack in args.attacks
        for arm in (CLEAN_ARMS if attack == CLEAN else args.arms)
        if attack != CLEAN or arm in args.arms
        for seed in args.seeds
    ]
    began, runs = time.perf_counter(), []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = [pool.submit(run_arm, attack, arm, seed, args) for attack, arm, seed in jobs]
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            runs.append(run)
            success = "-" if run["success"] is None else f"{run['success']:.3f}"
            print(f"{run['attack']:15s} {run['arm']:8s} seed {run['seed']:3d}: success {success}, accuracy "
                  f"{run['accuracy']:.3f}, honest rejected {run['honest_rejected']:.4f}", flush=True)  # fmt: skip
    table: dict = {}
    for attack, arm, _ in jobs:
        chosen = [r for r in runs if r["attack"] == attack and r["arm"] == arm]
        table.setdefault(attack, {})[arm] = summarise(sorted(chosen, key=lambda r: r["seed"]))
    setting = {
        **{k: v for k, v in vars(args).items() if k not in ("no_docs", "attacks", "arms", "jobs")},
        "task": TASK,
        "policy": dataclasses.asdict(SPEC),
        "warmup_accuracy": base,
        "tuning": bool(tuning),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": " ".join(["benchmarks/attacks.py", *sys.argv[1:]]),
        "seconds": time.perf_counter() - began,
    }
    name = "tuning" if tuning else "ablation"
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous.pop("rollouts", None)  # the single-seed table of the canonical-answer defenses, replaced
    document = {**previous, name: {"setting": setting, "table": table}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_name(f".{RESULTS.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, RESULTS)
    print(markdown(document[name]))
    if not args.no_docs and not tuning:
        write_section("rollouts", markdown(document[name]))
    return 0


def _cell(summary: dict, key: str) -> str:
    value = summary[key]
    if value is None:
        return "-"
    return f"{value['mean']:.0%} ({value['min']:.0%}-{value['max']:.0%})"


def markdown(section: dict) -> str:
    s, table = section["setting"], section["table"]
    arms = [a for a in ARMS if any(a in row for row in table.values())]
    lines = [
        "## Poisoned rollouts: each defense alone and all together, attack success and honest accuracy",
        "",
        f"`.venv/bin/python {s['command']}` ({wall_time(s['seconds'])}) — {s['honest']} honest nodes and 1 "
        f"attacker in one process per arm, task `{s['task']}` (working shown), {s['rounds']} rounds of "
        f"{s['prompts']} prompts, {s['group']} completions per prompt per node (top-{s['sample_top_k']} "
        f"sampling), F-TIS, lr {s['lr']}, KL {s['kl_coef']}; horizontal layout but for the vertical trick. "
        f"Policy d 48, 2 blocks, {s['policy']['warmup_steps']} warm-up steps: {s['warmup_accuracy']:.0%} "
        f"held-out accuracy to start. Seeds {', '.join(map(str, s['seeds']))} (tuning uses seeds "
        f"{', '.join(map(str, TUNING_SEEDS))} only). Each cell: attack success, then the honest nodes' held-out "
        "accuracy at the end (greedy, 128 prompts), each the mean over seeds with their range. `none`: no "
        "check, claimed rewards believed; every other arm recomputes rewards and adds: nothing (`rewards`), the "
        f"same-policy top-{s['top_k']} check (`top-k`), the claim judge (`judge`), the length rule "
        f"(+{s['length_excess']:.0%} over the group's shortest right answer or the node's remembered length of "
        "its own right answers, whichever is shorter, `length`), or all three (`all`). "
        "`clean`: no attacker. Success is the share of the honest nodes' fresh completions carrying the "
        "payload, mean over the last quarter of rounds.",
        "",
        "| attack | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for attack, row in table.items():
        cells = []
        for arm in arms:
            if arm not in row:
                cells.append("")
                continue
            success = "" if row[arm]["success"] is None else _cell(row[arm], "success") + " / "
            cells.append(success + _cell(row[arm], "accuracy"))
        lines.append(f"| {attack} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Honest foreign completions the checks refused, and the checks' time per node per round (`all` arm):",
        "",
        "| attack | honest rejected | attack rejected | checks, ms per round |",
        "|---|---|---|---|",
    ]
    for attack, row in table.items():
        if "all" in row:
            r = row["all"]
            ms = 1000 * r["defense_s_per_round"]["mean"]
            lines.append(
                f"| {attack} | {r['honest_rejected']['mean']:.2%} | {_cell(r, 'attack_rejected')} | {ms:.1f} |"
            )
    lines += ["", f"{s['machine']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
