"""Averaging: NoLoCo against DiLoCo's all-reduce and against no averaging, on real local swarms, on
the paper's terms: each method's own H, several seeds, and NoLoCo's ablations.

    .venv/bin/python benchmarks/averaging.py                       # 5 arms x 3 seeds, 300 steps: ~17 minutes
    .venv/bin/python benchmarks/averaging.py --arms noloco diloco --seeds 0 --steps 100   # a quick look

Arms (`ARMS`), each the same run, steps, data and seed per seed: `none` (replicas never share
weights), `noloco` (H = 50, the paper's), `diloco` (H = 100, the paper's, α 0.3, the authors' DiLoCo
momentum), and NoLoCo's ablations `noloco-gamma0` (no pull toward the pair mean) and `noloco-fixed`
(fixed lanes: replica i of a stage only feeds replica i of the next, `--routing fixed`). Every other
arm routes with random replicas (NoLoCo's routing, the daemon's default under NoLoCo): GWTF gives some
replicas more of a stage's microbatches than others, so arms routed differently would compare
routing as much as averaging. A swarm is a bootstrap peer, the workers and one data node, 1 torch
thread per process on 2 shared cores; `train.seed` (initialisation and data order) is the seed.
Reported: validation and final loss at equal steps (and so equal tokens), the largest rise of the
5-step moving average of the loss above its running minimum after step 30 (the spike a never-trained
replica causes when routing first reaches it), each stage's replica distance before every pair
update, and the wall time and bytes of one outer synchronisation; per arm, the median over seeds and each
seed's validation loss against DiLoCo's on the same seed (paired). Writes
benchmarks/results/averaging.json and its section of docs/benchmarks.md.
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

from shoal.demo.command import averaging_overrides
from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until
from shoal.run_files import FULL_PRECISION, load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "averaging.json"
# every arm exchanges int8 (DiLoCo's all-reduce cannot take the bundled runs' top-k), so that the
# methods differ only in how they average, as when these arms were measured
INT8 = {"averaging.codec": "int8"}
ARMS: dict[str, tuple[dict, str]] = {  # arm -> (run-config overrides, the data node's routing)
    "none": ({"averaging.mode": "none"}, "random"),
    "noloco": ({**averaging_overrides("noloco"), **INT8, "averaging.inner_steps": 50}, "random"),
    "diloco": ({**averaging_overrides("diloco"), **INT8, "averaging.inner_steps": 100}, "random"),
    "noloco-gamma0": (
        {**averaging_overrides("noloco"), **INT8, "averaging.inner_steps": 50, "averaging.gamma": 0.0},
        "random",
    ),
    "noloco-fixed": ({**averaging_overrides("noloco"), **INT8, "averaging.inner_steps": 50}, "fixed"),
}
SUMMARY_HEADER = (
    "| arm | H | routing | val loss, median (range) | ÷ DiLoCo, same seed | last pair distance, median "
    "| exchange | abandoned |\n|" + "---|" * 8
)
HEADER = (
    "| arm | seed | val loss | final loss | worst rise | pair / local outer steps | exchange "
    "| bytes each way | distance | tokens/s | busiest | abandoned |\n|" + "---|" * 12
)


def worst_rise(losses: list[float], after_step: int = 30, window: int = 5) -> float:
    """The largest rise of the moving average above its running minimum, after `after_step`."""
    averages = [statistics.fmean(losses[i - window + 1 : i + 1]) for i in range(window - 1, len(losses))]
    worst, low = 0.0, float("inf")
    for step, value in enumerate(averages, start=window - 1):
        low = min(low, value)
        if step > after_step:
            worst = max(worst, value - low)
    return worst


def busiest_shares(forwards_by_stage: dict[int, list[int]]) -> dict[str, float]:
    """Per block stage, the share of its forwards that its busiest replica ran (1/replicas: even)."""
    return {str(s): round(max(f) / sum(f), 3) for s, f in sorted(forwards_by_stage.items()) if sum(f)}


def run_swarm(run_file: Path, workdir: Path, replicas: int, routing: str, timeout_s: float) -> dict:
    run = load_run_config(str(run_file))
    swarm = LocalSwarm(workdir, log_level="INFO")
    stats = []
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = []
        for stage in range(1, run.pipeline.stages):
            for _ in range(replicas):
                stats.append(workdir / f"worker-{len(stats)}.json")
                workers.append(swarm.start_node([entry], "--role", "worker", "--stage", str(stage), "--threads", "1",
                                                "--stats-file", str(stats[-1]), wait=False))  # fmt: skip
        for worker in workers:
            swarm.wait_ready(worker)
        progress = workdir / "progress.jsonl"
        started = time.monotonic()
        swarm.start_node([entry], "--role", "data", "--threads", "1", "--routing", routing,
                         "--progress-file", str(progress))  # fmt: skip
        done = wait_until(lambda: done_event(progress), timeout_s, "the data node to finish")
        wall_s = time.monotonic() - started
        for worker in workers:
            swarm.stop(worker)
    finally:
        swarm.close(timeout_s=5)
    losses = [e["loss"] for e in progress_events(progress) if e["event"] == "step"]
    engines = [json.loads(p.read_text())["engine"] for p in stats if p.exists()]
    averaging = [e.get("averaging", {}) for e in engines]
    exchanges = [t for a in averaging for t in a.get("exchange_s", [])]
    by_stage: dict[int, list] = {}
    forwards: dict[int, list[int]] = {}
    for index, path in enumerate(stats):
        if path.exists():
            engine = json.loads(path.read_text())["engine"]
            distances = engine.get("averaging", {}).get("replica_distance", [])
            by_stage.setdefault(1 + index // replicas, []).extend(distances)
            forwards.setdefault(1 + index // replicas, []).append(engine["forwards"])
    return {
        "replicas_per_stage": replicas,
        "mode": run.averaging.mode,
        "inner_steps": run.averaging.inner_steps,
        "gamma": run.averaging.gamma,
        "seed": run.train.seed,
        "routing": routing,
        "busiest_replica_share": busiest_shares(forwards),
        "steps": done["steps"],
        "val_loss": done["val_loss"],
        "final_loss": done["final_loss"],
        "worst_rise_after_30": round(worst_rise(losses), 4),
        "abandoned": done["microbatches_abandoned"],
        "tokens_per_s": done["tokens_per_s"],
        "wall_s": round(wall_s, 1),
        "pair_steps": sum(a.get("pair_steps", a.get("group_steps", 0)) for a in averaging),
        "local_steps": sum(a.get("local_steps", 0) for a in averaging),
        "exchange_s_median": statistics.median(exchanges) if exchanges else None,
        "exchange_s_range": [min(exchanges), max(exchanges)] if exchanges else None,
        "bytes_per_exchange": max((a.get("bytes_per_exchange", 0) for a in averaging), default=0),
        "replica_distance": {str(s): sorted(d) for s, d in by_stage.items()},
        "losses": losses,
    }


def last_distance(run: dict) -> float | None:
    """The mean over block stages of each stage's last measured replica distance (None: never measured)."""
    last = [d[-1][1] for d in run["replica_distance"].values() if d]
    return statistics.fmean(last) if last else None


def summarise(runs: list[dict]) -> list[dict]:
    """Per arm: medians and ranges over seeds, and each seed's val loss over DiLoCo's on that seed."""
    diloco = {r["seed"]: r["val_loss"] for r in runs if r["arm"] == "diloco"}
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        losses = [r["val_loss"] for r in mine]
        ratios = [r["val_loss"] / diloco[r["seed"]] for r in mine if r["seed"] in diloco]
        distances = [d for d in map(last_distance, mine) if d is not None]
        exchanges = [r["exchange_s_median"] for r in mine if r["exchange_s_median"] is not None]
        rows.append({
            "arm": arm, "inner_steps": mine[0]["inner_steps"], "routing": mine[0]["routing"],
            "seeds": [r["seed"] for r in mine], "val_loss_median": statistics.median(losses),
            "val_loss_range": [min(losses), max(losses)], "vs_diloco": ratios,
            "last_distance_median": statistics.median(distances) if distances else None,
            "exchange_s_median": statistics.median(exchanges) if exchanges else None,
            "abandoned": sum(r["abandoned"] for r in mine),
        })  # fmt: skip
    return rows


def markdown(result: dict) -> str:
    summary = []
    for a in result["summary"]:
        ratio = "-"
        if a["vs_diloco"] and a["arm"] != "diloco":
            ratio = f"{statistics.median(a['vs_diloco']):.4f} ({min(a['vs_diloco']):.4f}-{max(a['vs_diloco']):.4f})"
        distance = "-" if a["last_distance_median"] is None else f"{a['last_distance_median']:.3f}"
        exchange = "-" if a["exchange_s_median"] is None else f"{1e3 * a['exchange_s_median']:.0f} ms"
        low, high = a["val_loss_range"]
        h = "-" if a["arm"] == "none" else a["inner_steps"]
        summary.append(
            f"| {a['arm']} | {h} | {a['routing']} | {a['val_loss_median']:.3f} ({low:.3f}-{high:.3f}) "
            f"| {ratio} | {distance} | {exchange} | {a['abandoned']} |"
        )
    rows = []
    for r in result["runs"]:
        exchange = "-" if r["exchange_s_median"] is None else f"{1e3 * r['exchange_s_median']:.0f} ms"
        first_last = []
        for stage, d in sorted(r["replica_distance"].items()):
            if d:
                first_last.append(f"s{stage}: {d[0][1]:.3f} → {d[-1][1]:.3f}")
        rows.append(
            f"| {r['arm']} | {r['seed']} | {r['val_loss']:.3f} | {r['final_loss']:.3f} | "
            f"{r['worst_rise_after_30']:.2f} | {r['pair_steps']} / {r['local_steps']} | {exchange} | "
            f"{r['bytes_per_exchange'] / 2**20:.2f} MiB | {'; '.join(first_last) or '-'} | "
            f"{r['tokens_per_s']:,.0f} | "
            f"{', '.join(f's{s}: {v:.2f}' for s, v in r['busiest_replica_share'].items()) or '-'} | {r['abandoned']} |"
        )
    return f"""# Averaging: NoLoCo against DiLoCo's all-reduce and against replicas that never share weights

`{result["command"]}` ({result["steps"]} steps of the bundled `tiny` run per swarm, {result["replicas"]} replicas
per block stage, seeds {", ".join(map(str, result["seeds"]))} (`train.seed`: initialisation and data order), each
method at the paper's H (NoLoCo 50, DiLoCo 100), everything sent as float32; 2 shared cores). "÷
DiLoCo" is each seed's validation loss over DiLoCo's on the same seed, median (range); "last pair
distance" is a replica's L2 distance to its partner just before its last pair update, mean over
block stages, median over seeds; "exchange" is the median wall time of one pair exchange (NoLoCo) or
one all-reduce round (DiLoCo, hivemind's `DecentralizedAverager`, matchmaking included), waiting for
the others included; "abandoned" counts microbatches over all seeds.

{SUMMARY_HEADER}
{chr(10).join(summary)}

Every run: "worst rise" is the largest rise of the 5-step moving average of the training loss above its
running minimum after step 30; "distance" is each stage's replica distance before its first and last pair
update; "pair / local" counts pair updates or all-reduce rounds, and local fallbacks, over all replicas;
"tokens/s" is the data node's over the whole run, outer steps included; "busiest" is the share of a
stage's forwards that its busiest replica ran.

{HEADER}
{chr(10).join(rows)}

The paper (noloco.md §3) compares NoLoCo (H = 50) with DiLoCo (H = 100) and FSDP at 125M-6.8B
parameters: NoLoCo's perplexity within about 1-4 % of DiLoCo's, better in most settings (e.g. 125M,
8 GPUs, DP 4 x PP 2: 26.4 vs 26.8 on Reddit), and an outer sync that does not grow with the number of
replicas. Its ablations: γ = 0 lets the replicas' spread grow and the loss worsen; random routing
(without outer sync) lowers the spread between replicas by about 10-15 % at up to 4 % perplexity
against fixed routing. Our fixed-lanes arm runs with NoLoCo's outer sync, not without it: a run
without averaging measures no replica distance here.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default=str(ROOT / "shoal" / "runs" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=2, help="workers per block stage")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    base = load_run_config(args.run_config).replace({**FULL_PRECISION, "train.steps": args.steps})
    runs = []
    with tempfile.TemporaryDirectory(prefix="shoal-averaging-") as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                overrides, routing = ARMS[arm]
                workdir = Path(tmp) / f"{arm}-{seed}"
                workdir.mkdir()
                run_file = workdir / "run.toml"
                run_file.write_text(base.replace({**overrides, "train.seed": seed}).to_toml())
                print(f"{arm}, seed {seed} ...", file=sys.stderr, flush=True)
                runs.append({"arm": arm, **run_swarm(run_file, workdir, args.replicas, routing, args.timeout)})
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "losses"}), file=sys.stderr, flush=True)
    assert len({r["steps"] for r in runs}) == 1, "every swarm must train the same steps"
    result = {
        "command": "python benchmarks/averaging.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "replicas": args.replicas,
        "seeds": args.seeds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": summarise(runs),
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if not args.no_docs:
        write_section("averaging", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
