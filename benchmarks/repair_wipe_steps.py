"""Where a stage is worth more: the repair rules on the live test's run, wiped before each of many steps.

    .venv/bin/python benchmarks/repair_wipe_steps.py     # 10 wipe steps x 4 rules: about 30 s on one thread

`tests/test_node_churn.py` kills the middle stage of a running swarm of real daemons at one pinned
step and compares CheckFree+ with random re-initialisation on the same seed. This benchmark runs that
run (the tests' hermetic pseudo-English, three one-layer block stages, init std 0.2, lr 2e-3, 48 steps,
every other microbatch swapped, the pairs taking turns) in one process, with benchmarks/repair.py's
`Pipeline`, and wipes stage 2 before each of a range of steps instead: how far the rules' ordering
holds away from the pinned step. Every rule branches from the same no-failure run at each wipe step.
The validation loss is evaluated after every step (no batch noise): **jump** is its rise over the
repair, **steps back** the steps from the repair until it is back under its value before the wipe
(`shoal.train.repair.steps_to_recover`), "not back" within the steps left in the run.

Writes benchmarks/results/repair_wipe_steps.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from docs_section import write_section
from repair import Pipeline

from shoal.config import RunConfig
from shoal.train.data import BatchSampler, TokenSplits, load_token_splits
from shoal.train.repair import steps_to_recover

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny import tiny_run, write_tiny_run  # noqa: E402
from tests.test_node_churn import RECOVERY_STEPS, REPAIR_RUN, WIPED_AT  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "repair_wipe_steps.json"
RULES = ["checkfree_plus", "uniform", "copy", "random"]
LABELS = {"checkfree_plus": "CheckFree+ (gradient-weighted)", "uniform": "uniform average",
          "copy": "copy one neighbour", "random": "random re-initialisation"}  # fmt: skip
STAGE = 2  # the middle block stage: no swap partner, both neighbours alive


def the_run(rule: str, workdir: Path) -> RunConfig:
    return tiny_run(**REPAIR_RUN, **{"repair.rule": rule, "data.path": str(workdir / "corpus.txt")})


def wipe_at(base: Pipeline, run: RunConfig, splits: TokenSplits, batches: list, wipe: int) -> dict:
    pipe = base.branch(run)
    val = {wipe - 1: pipe.evaluate(splits)}
    (record,) = pipe.repair([STAGE], wipe)
    for step in range(wipe, run.train.steps):
        pipe.train_step(batches[step])
        val[step] = pipe.evaluate(splits)
    return {
        "wipe": wipe,
        "rule_applied": record["rule"],
        "jump": val[wipe] - val[wipe - 1],
        "steps_back": steps_to_recover(val, val[wipe - 1], wipe),
        "steps_left": run.train.steps - wipe,
        "val": {str(k): v for k, v in sorted(val.items())},
    }


def measure(wipes: list[int]) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="shoal-wipe-steps-"))
    write_tiny_run(workdir, **REPAIR_RUN)  # the tests' corpus file
    first = the_run(RULES[0], workdir)
    splits = load_token_splits(first.data, first.model.vocab_size)
    t = first.train
    sampler = BatchSampler(splits.train, t.seq_len, t.batch_size, t.seed)
    batches = [sampler.batch(step) for step in range(t.steps)]
    base, copies = Pipeline(first), {}
    for step in range(t.steps):  # the no-failure run, copied before each wipe step
        if step in wipes:
            copies[step] = base.branch(base.run)
        base.train_step(batches[step])
    rows = {rule: [wipe_at(copies[w], the_run(rule, workdir), splits, batches, w) for w in wipes] for rule in RULES}
    return {"run": json.loads(first.to_json()), "rows": rows}


def _count(row: dict) -> str:
    return "not back" if row["steps_back"] is None else str(row["steps_back"])


def summarise(result: dict) -> dict:
    rows, pinned = result["rows"], result["pinned"]
    ours, random = rows["checkfree_plus"], rows["random"]

    def back(row: dict) -> float:
        return math.inf if row["steps_back"] is None else row["steps_back"]

    sooner = [back(r) - back(c) for c, r in zip(ours, random, strict=True)]  # nan where neither is back
    separated = [c["wipe"] for c, r in zip(ours, random, strict=True)
                 if c["steps_back"] is not None and c["steps_back"] <= pinned["bound"]
                 and (r["steps_back"] is None or r["steps_back"] > pinned["bound"])]  # fmt: skip
    return {
        "checkfree_sooner_or_equal": sum(s >= 0 for s in sooner),
        "checkfree_strictly_sooner": sum(s > 0 for s in sooner),
        "random_not_back": sum(r["steps_back"] is None for r in random),
        "wipes": len(ours),
        "separated_by_bound": separated,
        "median_jump": {rule: statistics.median(r["jump"] for r in rows[rule]) for rule in rows},
    }


def markdown(result: dict) -> str:
    rows, summary, pinned = result["rows"], result["summary"], result["pinned"]
    wipes = [r["wipe"] for r in rows[RULES[0]]]
    lines = [
        "## CheckFree on the live test's run: the rules, wiped before each of many steps",
        "",
        f"`{result['command']}` ({result['wall_s']:.0f} s on one torch thread, 2 shared cores). The run of",
        "`tests/test_node_churn.py` (the tests' hermetic pseudo-English; three one-layer block stages, init std",
        f"0.2, lr 2e-3, {result['run']['train']['steps']} steps; every other microbatch swapped, the two pairs",
        "taking turns) in one process, benchmarks/repair.py's `Pipeline`; stage 2, the middle one, wiped before",
        "each step below and rebuilt by each rule from the same no-failure run. Validation loss after every step.",
        "Cells: **jump** of the validation loss over the repair / **steps back** under its value before the wipe.",
        "",
        "| rule | " + " | ".join(f"wiped before {w}" for w in wipes) + " | median jump |",
        "|---|" + "---|" * (len(wipes) + 1),
    ]
    for rule in RULES:
        cells = [f"{r['jump']:.2f} / {_count(r)}" for r in rows[rule]]
        lines.append(f"| {LABELS[rule]} | " + " | ".join(cells) + f" | {summary['median_jump'][rule]:.2f} |")
    lines += [
        "",
        "Expected (paper): spikes random ≫ copy > uniform > gradient-weighted; recovery in the same order.",
        "",
        f"- CheckFree+ was back no later than random at {summary['checkfree_sooner_or_equal']} of"
        f" {summary['wipes']} wipe steps and strictly sooner at {summary['checkfree_strictly_sooner']};"
        f" random was not back within the run at {summary['random_not_back']}.",
        f"- The live test pins the wipe before step {pinned['wipe']} and asks CheckFree to be back within"
        f" {pinned['bound']} steps where random is not: that bound separates the two rules at wipe steps"
        f" {summary['separated_by_bound']} of these.",
        "",
        f"x86_64, {result['machine']['cpus']} cores, torch {result['machine']['torch']}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wipes", type=int, nargs="+", default=[20, 22, 24, 25, 26, 27, 28, 29, 30, 32])
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the saved JSON only")
    args = parser.parse_args()
    if args.render:
        text = markdown(json.loads(RESULTS.read_text()))
        write_section("checkfree-wipe-steps", text)
        print(text)
        return 0
    torch.set_num_threads(1)
    started = time.monotonic()
    result = measure(sorted(args.wipes))
    result.update(
        command=" ".join(["python benchmarks/repair_wipe_steps.py", *(a for a in sys.argv[1:] if a != "--no-docs")]),
        pinned={"wipe": WIPED_AT, "bound": RECOVERY_STEPS},
        machine={"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        wall_s=time.monotonic() - started,
    )
    result["summary"] = summarise(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    text = markdown(result)
    if not args.no_docs:
        write_section("checkfree-wipe-steps", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
