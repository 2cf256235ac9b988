"""What stage backups cost a fault-free swarm: bytes per outer step, host memory per node, tokens/s.

The bundled run (every default on: int8 wire, NoLoCo with top-k exchanges, step audits, backups at each
outer step) on a local swarm of a bootstrap peer, a data node and 2 workers per block stage, trained
the same steps with backups on (`repair.backup_every`, the default) and off (0), in alternating rounds.
Every worker writes its stats file at exit (SIGTERM after the data node's last step); from it:

- a keeper's bytes pulled per snapshot, each either a change (int8 blocks of the change since the
  snapshot it holds) or whole (float32, when it holds none of that replica's chain), against what the
  same snapshots would have cost as θ and φ whole in float32 (the rule before: 8 bytes a parameter);
- the host memory a worker holds for backups: its keeper's snapshot of the neighbouring stage, its own
  stage's latest snapshot and the change that led to it;
- tokens/s with backups on ÷ off (same steps, data and seed; medians over rounds).

    python benchmarks/backup_cost.py                 # tiny, 2 rounds of 80 steps, about 8 minutes
    python benchmarks/backup_cost.py --run small --steps 40 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until
from shoal.model.stages import stage_layers
from shoal.planning.memory import stage_params
from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"on": {}, "off": {"repair.backup_every": 0}}
REPLICAS = 2


def one_arm(arm: str, run_file: Path, workdir: Path, stages: int) -> dict:
    swarm = LocalSwarm(workdir)
    stats_files = {}
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        for stage in range(1, stages):
            for replica in range(REPLICAS):
                name = f"stage{stage}r{replica}"
                stats_files[name] = workdir / f"{name}.stats.json"
                swarm.start_node([entry], "--stage", str(stage), "--stats-file", str(stats_files[name]), name=name)
        progress = workdir / "progress.jsonl"
        swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), name="data")
        done = wait_until(lambda: done_event(progress), 1800, f"the backups-{arm} arm to train")
        for peer in swarm.peers:
            if peer.name.startswith("stage"):
                swarm.stop(peer)  # SIGTERM: the stats file is written at exit
    finally:
        swarm.close()
    steps = [e for e in progress_events(progress) if e["event"] == "step"]
    workers = {name: json.loads(path.read_text()) for name, path in stats_files.items()}
    engines = {name: s["engine"] for name, s in workers.items()}
    return {
        "arm": arm,
        "steps": len(steps),
        "tokens_per_s": sum(e["tokens"] for e in steps[1:]) / sum(e["step_s"] for e in steps[1:]),
        "final_loss": steps[-1]["loss"],
        "microbatches_injected": done["microbatches_injected"],
        "microbatches_completed": done["microbatches_completed"],
        "microbatches_abandoned": done["microbatches_abandoned"],
        "keepers": {name: e["backup"] for name, e in engines.items() if e.get("backup")},
        "sources": {name: e["backup_source"] for name, e in engines.items() if e.get("backup_source")},
    }


def summarize(rows: list[dict], params: dict[int, int]) -> dict:
    on = [r for r in rows if r["arm"] == "on"]
    keepers = [k for r in on for k in r["keepers"].values()]
    sources = [s for r in on for s in r["sources"].values()]
    pulls = sum(k["changes"] + k["wholes"] for k in keepers)
    fetched = sum(k["bytes_fetched"] for k in keepers)
    # the same pulls as θ and φ whole, float32 (the rule before this one), by the stage each keeper kept
    whole_pairs = sum(8 * params[k["stage"]] * (k["changes"] + k["wholes"]) for k in keepers)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"]
              for a, b in zip(on, [r for r in rows if r["arm"] == "off"], strict=True)]  # fmt: skip
    return {
        "pulls": pulls,
        "changes": sum(k["changes"] for k in keepers),
        "wholes": sum(k["wholes"] for k in keepers),
        "refused": sum(k["refused"] for k in keepers),
        "bytes_fetched": fetched,
        "bytes_per_pull": fetched / pulls if pulls else None,
        "bytes_per_pull_as_whole_theta_phi": whole_pairs / pulls if pulls else None,
        "saving": whole_pairs / fetched if fetched else None,
        "bytes_per_change_per_param": statistics.median(
            (k["bytes_fetched"] - k["wholes"] * 4 * params[k["stage"]]) / k["changes"] / params[k["stage"]]
            for k in keepers
            if k["changes"]
        ),
        "keeper_bytes_held": max(k["bytes_held"] for k in keepers),
        "source_bytes_held": max(s["bytes_held"] for s in sources),
        "tokens_per_s_on_over_off": statistics.median(ratios),
        "tokens_per_s_on_over_off_range": [min(ratios), max(ratios)],
    }


def markdown(result: dict) -> str:
    s, c = result["summary"], result["config"]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    params = ", ".join(f"stage {k}: {v:,}" for k, v in result["params"].items())
    return "\n".join([
        f"## What stage backups cost a fault-free swarm ({c['run_name']})",
        "",
        f"Reproduce: `{result['command']}` ({wall_time(result['wall_s'])}, {result['date']}): the bundled "
        f"`{c['run_name']}` run with every default on, {c['steps']} steps, {REPLICAS} workers per block stage, "
        f"{c['rounds']} round(s) of backups on and off; block stages' parameters {params}. 0 microbatches lost "
        "in every arm.",
        "",
        "| | measured |",
        "|---|---|",
        f"| snapshots pulled by keepers (as a change / whole) | {s['pulls']} ({s['changes']} / {s['wholes']}) |",
        f"| bytes per pull | {s['bytes_per_pull']:,.0f} |",
        f"| the same pulls as θ and φ whole in float32 (the rule before) | {s['bytes_per_pull_as_whole_theta_phi']:,.0f} |",  # noqa: E501
        f"| saving (first pulls whole included; a change alone: 8 ÷ 1.06 = 7.5x) | {s['saving']:.1f}x |",
        f"| bytes per parameter of a change (median over keepers) | {s['bytes_per_change_per_param']:.3f} |",
        f"| host memory a keeper holds (the neighbour's snapshot) | {mib(s['keeper_bytes_held'])} |",
        f"| host memory a replica holds for its own chain (its snapshot and last two changes) | "
        f"{mib(s['source_bytes_held'])} |",
        f"| tokens/s, backups on ÷ off (median, range) | {s['tokens_per_s_on_over_off']:.2f} "
        f"({s['tokens_per_s_on_over_off_range'][0]:.2f}-{s['tokens_per_s_on_over_off_range'][1]:.2f}) |",
        f"| snapshots refused by their digest | {s['refused']} |",
        "",
        "A snapshot is taken at each outer step (φ; θ ← φ there) and pulled once per keeper; a keeper that",
        "holds the replica's previous snapshot gets the int8 change (1.06 bytes a parameter: a float32 scale",
        "per 64 values), else the snapshot whole (4 bytes a parameter). Its benefit is in the repair tables",
        "(benchmarks/repair.py, benchmarks/real_model_repair.py).",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="tiny", help="a bundled run")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the docs section from --results")
    args = parser.parse_args()
    args.results = args.results or ROOT / "benchmarks" / "results" / f"backup_cost_{args.run}.json"
    section = f"backup-cost-{args.run}"
    if args.markdown_only:
        print(f"wrote {write_section(section, markdown(json.loads(args.results.read_text())), args.doc)}")
        return
    run = load_run_config(args.run).replace({"train.steps": args.steps})
    stages = run.pipeline.stages
    params = {s: stage_params(run.model, len(stage_layers(run.model.n_layers, stages, s)), s) for s in range(1, stages)}
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shoal-backup-cost-") as tmp:
        for round_ in range(args.rounds):
            for arm, overrides in ARMS.items():
                run_file = Path(tmp) / f"run-{arm}.toml"
                run_file.write_text(run.replace(overrides).to_toml())
                row = one_arm(arm, run_file, Path(tmp) / f"{arm}-{round_}", stages)
                assert row["steps"] == args.steps and row["microbatches_abandoned"] == 0, row
                assert row["microbatches_completed"] == row["microbatches_injected"], row
                assert bool(row["keepers"]) == (arm == "on"), row
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    result = {
        "what": "the bundled run's swarm with stage backups on and off: bytes, memory, tokens/s",
        "command": " ".join(["python", "benchmarks/backup_cost.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.monotonic() - started,
        "config": {"run_name": args.run, "steps": args.steps, "rounds": args.rounds, "replicas": REPLICAS},
        "params": params,
        "rows": rows,
        "summary": summarize(rows, params),
    }
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.results} and {write_section(section, markdown(result), args.doc)}")


if __name__ == "__main__":
    main()
