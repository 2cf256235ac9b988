"""Data nodes that agree: one data node against two that average stage 0, at equal tokens (issue 33).

    .venv/bin/python benchmarks/data_nodes.py                  # 3 seeds x 5 arms, 300 steps: ~40 minutes
    .venv/bin/python benchmarks/data_nodes.py --arms one "two, stage 0 gradients"   # some arms only

Every arm trains the bundled `tiny` run (everything sent as float32) with 2 workers per block stage and
NoLoCo (H = 10) on real daemons, on the same seeds and the same number of tokens: one data node
training `--steps` steps of 16 sequences on all of the data (`one`), or two data nodes, each on its half
of the data (`--data-shard k/2`), whose stage 0 (embedding, final norm, LM head) they average:
- `two, stage 0 gradients` (the default, `[averaging] stage0 = "gradients"`): they average its
  gradients before every optimizer step (data parallelism) and its weights every 10 steps, with half
  the batch each (the one data node's batch split between two, as data parallelism splits it);
- `two, stage 0 mean`: they replace its weights with their pair's mean after every step, half the
  batch each;
- `two, stage 0 outer`: stage 0 averaged as every stage is (NoLoCo pairs every H steps, with α, β, γ),
  half the batch each;
- `two, stage 0 outer, half the steps`: the same, for half the steps with the one's batch each.
Reported: each data node's validation loss at the end (its own stage 0 with the shared block stages),
a two-data-node arm's mean over its two, the stage-0 distance between the two data nodes before the
first and last of their pair updates, and the bytes the data nodes' stage-0 exchanges sent per trained
token. Writes benchmarks/results/data_nodes.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.demo.launcher import LocalSwarm, done_event, wait_until
from shoal.run_files import FULL_PRECISION, load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "data_nodes.json"


ARMS = {  # arm -> (data nodes, share of the steps each trains, share of the batch each trains, averaging.stage0)
    "one": (1, 1, 1, "gradients"),
    "two, stage 0 gradients": (2, 1, 2, "gradients"),
    "two, stage 0 mean": (2, 1, 2, "mean"),
    "two, stage 0 outer": (2, 1, 2, "outer"),
    "two, stage 0 outer, half the steps": (2, 2, 1, "outer"),
}


def run_swarm(run_file: Path, workdir: Path, data_nodes: int, timeout_s: float) -> dict:
    run = load_run_config(str(run_file))
    swarm = LocalSwarm(workdir, log_level="INFO")
    progress = [workdir / f"progress-{k}.jsonl" for k in range(data_nodes)]
    stats = [workdir / f"data-{k}.json" for k in range(data_nodes)]
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = [swarm.start_node([entry], "--role", "worker", "--stage", str(stage), "--threads", "1", wait=False)
                   for stage in range(1, run.pipeline.stages) for _ in range(2)]  # fmt: skip
        for worker in workers:
            swarm.wait_ready(worker)
        started = time.monotonic()
        nodes = [swarm.start_node([entry], "--role", "data", "--threads", "1", "--data-shard", f"{k}/{data_nodes}",
                                  "--progress-file", str(progress[k]), "--stats-file", str(stats[k]), wait=False)
                 for k in range(data_nodes)]  # fmt: skip
        done = [wait_until(lambda p=p: done_event(p), timeout_s, f"data node {p.stem}") for p in progress]
        wall_s = time.monotonic() - started
        for node in (*nodes, *workers):
            swarm.stop(node)
    finally:
        swarm.close(timeout_s=5)
    engines = [json.loads(path.read_text())["engine"] for path in stats if path.exists()]
    distances = [d for e in engines for d in e.get("averaging", {}).get("replica_distance", [])]
    tokens = data_nodes * run.train.steps * run.train.batch_size * run.train.seq_len
    stage0_bytes = sum(e.get("averaging", {}).get("bytes_sent", 0) for e in engines)
    stage0_bytes += sum((e.get("stage0_gradients") or {}).get("bytes_sent", 0) for e in engines)
    return {
        "data_nodes": data_nodes,
        "steps_each": run.train.steps,
        "batch_each": run.train.batch_size,
        "tokens": tokens,
        "stage0": run.averaging.stage0,
        "stage0_bytes_per_token": round(stage0_bytes / tokens, 1),
        "val_loss": [d["val_loss"] for d in done],
        "abandoned": sum(d["microbatches_abandoned"] for d in done),
        "stage0_distance": sorted(distances),
        "wall_s": round(wall_s, 1),
    }


def markdown(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        losses = r["val_loss"]
        distance = r["stage0_distance"]
        shown = f"{distance[0][1]:.3f} → {distance[-1][1]:.3f} ({len(distance)})" if distance else "-"
        rows.append(
            f"| {r['arm']} | {r['seed']} | {r['steps_each']} x {r['batch_each']} | {r['tokens']:,} | "
            f"{' / '.join(f'{v:.3f}' for v in losses)} | {statistics.fmean(losses):.3f} | {shown} | "
            f"{r['stage0_bytes_per_token']:,.0f} | {r['abandoned']} |"
        )
    means = {arm: [statistics.fmean(r["val_loss"]) for r in result["runs"] if r["arm"] == arm] for arm in ARMS}
    arms = [arm for arm in ARMS if means[arm]]
    left = [arm for arm in ARMS if not means[arm]]
    missing = f" (not run this time: {', '.join(f'`{arm}`' for arm in left)})" if left else ""
    one = means["one"]
    assert one, "the one data node's arm is the baseline: run it"
    lines = []
    for arm, values in means.items():
        if arm != "one" and values:
            gaps = [b - a for a, b in zip(one, values, strict=True)]
            spread = max(values) - min(values)
            lines.append(f"- {arm} minus one, per seed: {', '.join(f'{g:+.3f}' for g in gaps)} "
                         f"(median {statistics.median(gaps):+.3f}); its means spread over {spread:.3f}")  # fmt: skip
    return f"""# Data nodes that agree: one data node against two that average stage 0

`{result["command"]}` ({wall_time(result["seconds"])}; the bundled `tiny` run, everything as float32, 2
workers per block stage, NoLoCo every 10 steps, seeds {", ".join(map(str, result["seeds"]))}). At equal
tokens: one data node training {result["steps"]} steps of 16 sequences on all of the data, or two data
nodes each on its half, their stage 0's gradients averaged before every step and its weights every 10
(`stage0 = "gradients"`, the default), its weights replaced by the pair's mean after every step
(`"mean"`), or averaged as every stage (`"outer"`: NoLoCo every 10 steps, α 0.5, β 0.7, γ 0.7), with half
the batch each or (outer) for half the steps. "val loss" is each data node's own (its stage 0 with the
shared block stages); "stage-0 distance" is the two data nodes' L2 distance before their first and last
weight update (and how many); "stage-0 bytes" what their stage-0 exchanges sent per trained token.
This run's arms: {", ".join(f"`{arm}`" for arm in arms)}{missing}.

| arm | seed | steps x batch, each | tokens | val loss | mean | stage-0 distance | stage-0 bytes/token | abandoned |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(lines)}
- the one data node's runs spread over {max(one) - min(one):.3f} across seeds
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="the one data node's steps (each of two: half)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="the arms to run")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the saved JSON only")
    args = parser.parse_args()
    if args.render:
        write_section("data-nodes", markdown(json.loads(RESULTS.read_text())))
        return 0
    began = time.perf_counter()
    base = load_run_config("tiny").replace(FULL_PRECISION)
    runs = []
    with tempfile.TemporaryDirectory(prefix="shoal-data-nodes-") as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                data_nodes, step_share, batch_share, stage0 = ARMS[arm]
                workdir = Path(tmp) / f"{len(runs)}"
                workdir.mkdir()
                run_file = workdir / "run.toml"
                sizes = {
                    "train.steps": args.steps // step_share,
                    "train.batch_size": base.train.batch_size // batch_share,
                    "averaging.stage0": stage0,
                }
                run_file.write_text(base.replace({**sizes, "train.seed": seed}).to_toml())
                print(f"{arm}, seed {seed} ...", file=sys.stderr, flush=True)
                runs.append({"arm": arm, "seed": seed, **run_swarm(run_file, workdir, data_nodes, args.timeout)})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    assert len({r["tokens"] for r in runs}) == 1, "both arms must train the same tokens"
    result = {
        "command": shlex.join(["python", "benchmarks/data_nodes.py", *sys.argv[1:]]),
        "steps": args.steps,
        "seeds": args.seeds,
        "seconds": time.perf_counter() - began,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if not args.no_docs:
        write_section("data-nodes", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
