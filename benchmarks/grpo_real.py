"""Collaborative GRPO on a real instruct model: three rollout workers post-train SmolLM2-135M-Instruct on
chat arithmetic, alone, sharing naively, and with F-TIS, one of them starting from another checkpoint.

    make smollm2                                                   # the GGUF, once
    .venv/bin/python benchmarks/grpo_real.py                       # 3 arms x 3 seeds, two at a time
    .venv/bin/python benchmarks/grpo_real.py --seeds 0 --rounds 2 --no-docs   # a smoke run

Three simulated workers in one process per (arm, seed), the horizontal layout (papers/ftis.md §1):
every round all three derive the same prompts of the task (`chat-add1` by default: "What is 3 + 7?
Answer with the number.", in the model's chat template, where this model's sampled replies mix right
and wrong ones; the answer is the last number of a reply that
ends, shoal/grpo/tasks.py). Workers a and b start from the instruct model as the GGUF holds it; worker c,
the odd one, from that model after a short supervised pass on another task (three-term sums answered
with the bare number), made here and exported as a checkpoint in the same tokenizer. A sharing worker
samples G/3 completions of each prompt, sends them as a `RolloutBundle` and trains on the group of G
with the two others' (`shoal.grpo.round.learn`: validation, the defenses, local rewards, one Adam step);
"alone" samples all G itself. Only the last `--train-last` blocks and the final norm train (a full
backward of 135 M parameters would be most of a round on a CPU). Sampling: temperature 1 over each
step's top `--sample-top-k` tokens, the run default, whose log-probs are those of the distribution
sampled from, so F-TIS's ratios compare like with like.

Held-out accuracy is on the operand pairs training never shows (9 distinct prompts for `chat-add1`),
before the first round and after the last: greedy, and sampled as in training (`--eval-samples` replies
a prompt), the finer of the two. Reported per round: seconds of generation, scoring,
checking received bundles, and the update. Writes benchmarks/results/grpo_real.json and its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from docs_section import wall_time, write_section

from shoal.grpo.policy import Policy
from shoal.grpo.sampling import sample
from shoal.grpo.tasks import CORRECT_REWARD, Prompt, Task

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "grpo_real.json"
GGUF = Path("~/.cache/shoal/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
ARMS = ("alone", "naive", "ftis")
WORKERS = ("a", "b", "c")  # c: the odd one


def odd_checkpoint(args: argparse.Namespace) -> Path:
    """The instruct model after `--odd-steps` supervised steps on three-term sums, as a checkpoint
    folder in the model's own tokenizer (made once, then reused from the cache)."""
    from shoal.grpo.policy import CheckpointPolicySpec
    from shoal.grpo.warmup import warm_up
    from shoal.model.checkpoint import read_checkpoint
    from shoal.model.corpus import cache_dir
    from shoal.model.hf import export_checkpoint

    base = read_checkpoint(GGUF)
    spec = CheckpointPolicySpec("chat-add2x3", base, warmup_steps=args.odd_steps, warmup_batch=8, warmup_lr=args.odd_lr)
    out = cache_dir() / "grpo-real" / f"odd-{spec.model_id}"
    if not (out / "config.json").is_file():
        torch.set_num_threads(2)
        policy, report = warm_up(spec)
        print(f"odd checkpoint: {args.odd_steps} supervised steps in {report['seconds']:.0f} s, "
              f"loss {report['final_loss']:.3f}", flush=True)  # fmt: skip
        export_checkpoint(out, base.model, policy.head, [policy.body], None, source=base.path)
    return out


def sampled_replies(
    policy: Policy, task: Task, heldout: list[Prompt], samples: int, top_k: int
) -> list[tuple[str, str]]:
    """(prompt text, reply) for `samples` replies to each held-out prompt, sampled as in training; the
    generator is seeded the same for every policy, so arms compared on these draw alike."""
    tokenizer = policy.spec.tokenizer()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        out = sample(policy, [tokenizer.encode_prompt(p.text) for p in heldout], samples, task.max_new_tokens,
                     tokenizer.eos_id, generator, top_k=top_k)  # fmt: skip
    return [(heldout[row].text, tokenizer.decode(c)) for row, c in zip(out.prompt_rows, out.completions, strict=True)]


def share_correct(task: Task, replies: list[tuple[str, str]]) -> float:
    """The share of `replies` that earn the full reward."""
    return sum(task.reward(prompt, reply) == CORRECT_REWARD for prompt, reply in replies) / max(len(replies), 1)


def run_arm(arm: str, seed: int, args: argparse.Namespace, odd: Path) -> dict:
    """One arm of one seed: three workers, `args.rounds` rounds; accuracy before and after, time split."""
    from shoal.grpo.defenses import LengthMemory
    from shoal.grpo.evaluate import accuracy, heldout_prompts
    from shoal.grpo.loss import GRPOConfig
    from shoal.grpo.policy import CheckpointPolicySpec
    from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
    from shoal.grpo.tasks import get_task
    from shoal.model.checkpoint import read_checkpoint

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    task = get_task(args.task)
    checkpoints = [read_checkpoint(GGUF)] * 2 + [read_checkpoint(odd)]
    specs = [CheckpointPolicySpec(args.task, c, seed=seed, warmup_steps=0, train_last=args.train_last)
             for c in checkpoints]  # fmt: skip
    policies = [Policy(s) for s in specs]
    share = args.group if arm == "alone" else args.group // len(WORKERS)
    cfg = RoundConfig(task=args.task, run_seed=seed, prompts_per_round=args.prompts, completions_per_prompt=share,
                      max_foreign_per_prompt=share, lr=args.lr, grpo=GRPOConfig(mode=arm),
                      sample_top_k=args.sample_top_k)  # fmt: skip
    optimizers = [make_optimizer(p, cfg) for p in policies]
    memories = [LengthMemory(cfg.defense.length_memory) for _ in policies]
    generators = [torch.Generator().manual_seed(1000 * seed + k) for k in range(len(WORKERS))]
    heldout = list({p.text: p for p in heldout_prompts(task, 0, args.eval_prompts)}.values())  # distinct pairs

    def sampled_accuracy(policy: Policy) -> float:
        return share_correct(task, sampled_replies(policy, task, heldout, args.eval_samples, args.sample_top_k))

    started = time.perf_counter()
    before = [accuracy(p, task, heldout) for p in policies]
    sampled_before = [sampled_accuracy(p) for p in policies]
    times = {"generation_s": [], "score_s": [], "defense_s": [], "update_s": []}
    rounds = []
    for r in range(args.rounds):
        prompts = round_prompts(cfg, r)
        bundles = []
        for policy, generator in zip(policies, generators, strict=True):
            began = time.perf_counter()
            bundles.append(make_bundle(policy, cfg, prompts, generator))
            times["generation_s"].append(time.perf_counter() - began)
        for k, policy in enumerate(policies):
            foreign = [] if arm == "alone" else [b for j, b in enumerate(bundles) if j != k]
            report = learn(policy, optimizers[k], cfg, prompts, bundles[k], foreign, memory=memories[k])
            for key in ("score_s", "defense_s", "update_s"):
                times[key].append(getattr(report, key))
            rounds.append({"round": r, "worker": WORKERS[k], "own_correct": report.own_correct,
                           "foreign_used": report.loss.foreign_used, "foreign_dropped": report.loss.foreign_dropped,
                           "foreign_rejected": report.foreign_rejected, "refused": len(report.refused)})  # fmt: skip
        print(f"{arm} seed {seed} round {r}: own correct "
              + " ".join(f"{row['own_correct']:.2f}" for row in rounds[-len(WORKERS):]), flush=True)  # fmt: skip
    after = [accuracy(p, task, heldout) for p in policies]
    sampled_after = [sampled_accuracy(p) for p in policies]
    return {"arm": arm, "seed": seed, "before": before, "after": after, "sampled_before": sampled_before,
            "sampled_after": sampled_after, "heldout_prompts": len(heldout), "rounds": rounds,
            "time_split_s": {k: statistics.median(v) for k, v in times.items()},
            "model_ids": [s.model_id for s in specs], "wall_s": time.perf_counter() - started}  # fmt: skip


def summarise(runs: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        workers = {}
        for k, name in enumerate(WORKERS):
            gains = [r["after"][k] - r["before"][k] for r in mine]
            sampled = [r["sampled_after"][k] for r in mine]
            workers[name] = {"before": statistics.median(r["before"][k] for r in mine),
                             "after": statistics.median(r["after"][k] for r in mine),
                             "after_range": [min(r["after"][k] for r in mine), max(r["after"][k] for r in mine)],
                             "gain": statistics.median(gains), "gain_range": [min(gains), max(gains)],
                             "sampled_before": statistics.median(r["sampled_before"][k] for r in mine),
                             "sampled_after": statistics.median(sampled),
                             "sampled_after_range": [min(sampled), max(sampled)]}  # fmt: skip
        split = {key: statistics.median(r["time_split_s"][key] for r in mine) for key in mine[0]["time_split_s"]}
        out[arm] = {"workers": workers, "seeds": len(mine), "time_split_s": split}
    return out


def markdown(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    rows = []
    for arm, s in summary.items():
        cells = []
        for name in WORKERS:
            w = s["workers"][name]
            lo, hi = w["sampled_after_range"]
            cells.append(f"{100 * w['before']:.0f} → {100 * w['after']:.0f}; {100 * w['sampled_before']:.0f} → "
                         f"{100 * w['sampled_after']:.0f} ({100 * lo:.0f}–{100 * hi:.0f})")  # fmt: skip
        t = s["time_split_s"]
        rows.append(f"| {arm} | {' | '.join(cells)} | {t['generation_s']:.1f} / {t['score_s']:.2f} / "
                    f"{t['defense_s']:.2f} / {t['update_s']:.1f} |")  # fmt: skip
    verdict = ""
    if "ftis" in summary and "alone" in summary:
        odd_ftis, odd_alone = summary["ftis"]["workers"]["c"], summary["alone"]["workers"]["c"]
        diff = 100 * (odd_ftis["sampled_after"] - odd_alone["sampled_after"])
        side = "above" if diff > 0 else "not above"
        verdict = (f"Sampled held-out accuracy: the odd worker c ends {diff:+.0f} points against training alone "
                   f"under F-TIS (medians over {summary['ftis']['seeds']} seeds: {side} alone).")  # fmt: skip
    intro = (
        f"Reproduce: `make smollm2 && .venv/bin/python benchmarks/grpo_real.py` ({wall_time(result['wall_s'])}, "
        f"{result['machine']}, two (arm, seed) runs at a time, 1 torch thread each). SmolLM2-135M-Instruct "
        "(Q4_1 GGUF, dequantized) post-trained by three simulated rollout workers on "
        f"`{cfg['task']}` ({cfg['rounds']} rounds of {cfg['prompts']} prompts, groups of {cfg['group']}, "
        f"the last {cfg['train_last']} blocks and the final norm training, Adam lr {cfg['lr']}, sampling over "
        f"the top {cfg['sample_top_k']} tokens at temperature 1, defenses on). Workers a and b start from the "
        f"instruct model; c from it after {cfg['odd_steps']} supervised steps on three-term sums (another "
        "checkpoint in the same tokenizer). Held-out accuracy in % on the task's held-out operand pairs "
        f"({result['runs'][0]['heldout_prompts']} distinct prompts): greedy before → after; then sampled "
        f"({cfg['eval_samples']} replies per prompt, as in training) before → after (range over seeds); medians "
        f"over {len(cfg['seeds'])} seed(s). Time split per worker-round: generation / scoring / checking "
        "received bundles / update, seconds (medians)."
    )
    return f"""
## Collaborative GRPO on SmolLM2-135M-Instruct: alone, naive sharing, F-TIS

{intro}

| arm | a | b | c (odd) | time split s |
|---|---|---|---|---|
{chr(10).join(rows)}

{verdict}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="chat-add1", help="chat-add1: where this model's groups mix right and wrong")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--group", type=int, default=6, help="completions per prompt in all (G)")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--train-last", type=int, default=4)
    parser.add_argument("--sample-top-k", type=int, default=4)
    parser.add_argument(
        "--eval-prompts", type=int, default=64, help="drawn from the held-out pairs; duplicates dropped"
    )
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--odd-steps", type=int, default=16)
    parser.add_argument("--odd-lr", type=float, default=2e-5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if not GGUF.is_file():
        sys.exit(f"{GGUF} is missing: run `make smollm2` first")
    started = time.monotonic()
    odd = odd_checkpoint(args)
    units = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(pool.map(run_arm, *zip(*units, strict=True), [args] * len(units), [odd] * len(units)))
    result = {"config": {k: v for k, v in vars(args).items() if k != "no_docs"}, "runs": runs,
              "summary": summarise(runs), "machine": f"{platform.machine()}, 2 cores",
              "wall_s": time.monotonic() - started}  # fmt: skip
    print(json.dumps(result["summary"], indent=1))
    if not args.no_docs:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        write_section("grpo-real", markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
