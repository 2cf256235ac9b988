"""Averaging: NoLoCo against DiLoCo's all-reduce and against no averaging, on real local swarms.

    .venv/bin/python benchmarks/averaging.py                       # 150 steps, 2 replicas: ~12 minutes
    .venv/bin/python benchmarks/averaging.py --replicas 2 4        # also 4 replicas per block stage

For each replica count, the same run, steps, data and seed with `averaging.mode` none, noloco and
diloco (α 0.3, the authors' DiLoCo momentum): a bootstrap peer, the workers and one data node, 1
torch thread per process on 2 shared cores. Every arm routes the same way (`--routing`, default
random, NoLoCo's): by default a daemon routes with GWTF unless it runs NoLoCo, and GWTF gives some
replicas more of a stage's microbatches than others (98-99 % to one of two before its routes counted
node load, 50-73 % since), so arms routed differently would compare routing as much as averaging.
Reported: validation and final loss at equal steps (and so equal tokens), the largest rise of the
5-step moving average of the loss above its running minimum after step 30 (the spike a never-trained
replica causes when routing first reaches it), each stage's replica distance before every pair
update, and the wall time and bytes of one outer synchronisation. Writes
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

from shoal.config import load_run_config
from shoal.demo.command import averaging_overrides
from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "averaging.json"
HEADER = (
    "| replicas per stage | averaging | val loss | final loss | worst rise | pair / local outer steps | exchange "
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


def markdown(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        exchange = "-" if r["exchange_s_median"] is None else f"{1e3 * r['exchange_s_median']:.0f} ms"
        first_last = []
        for stage, d in sorted(r["replica_distance"].items()):
            if d:
                first_last.append(f"s{stage}: {d[0][1]:.3f} → {d[-1][1]:.3f}")
        rows.append(
            f"| {r['replicas_per_stage']} | {r['mode']} | {r['val_loss']:.3f} | {r['final_loss']:.3f} | "
            f"{r['worst_rise_after_30']:.2f} | {r['pair_steps']} / {r['local_steps']} | {exchange} | "
            f"{r['bytes_per_exchange'] / 2**20:.2f} MiB | {'; '.join(first_last) or '-'} | "
            f"{r['tokens_per_s']:,.0f} | "
            f"{', '.join(f's{s}: {v:.2f}' for s, v in r['busiest_replica_share'].items()) or '-'} | {r['abandoned']} |"
        )
    return f"""# Averaging: NoLoCo against DiLoCo's all-reduce and against replicas that never share weights

`{result["command"]}` ({result["steps"]} steps of the bundled `tiny` run per swarm, same data and seed,
H = {result["inner_steps"]}, {result["routing"]} routing in every arm; one run each, on 2 shared cores).
"worst rise" is the largest rise of the 5-step moving average of the training loss above its running
minimum after step 30; "distance" is a replica's L2 distance to its partner just before a pair
update, first and last; "exchange" is the median wall time of one pair exchange (NoLoCo) or one
all-reduce round (DiLoCo, hivemind's `DecentralizedAverager`, matchmaking included), waiting for the
others included; "pair / local" counts pair updates or all-reduce rounds, and local fallbacks, over
all replicas; "tokens/s" is the data node's over the whole run, outer steps included; "busiest" is
the share of a stage's forwards that its busiest replica ran.

{HEADER}
{chr(10).join(rows)}

The paper (noloco.md §3) compares NoLoCo with DiLoCo and FSDP at 125M-6.8B parameters: NoLoCo's
perplexity within about 1-4 % of DiLoCo's, better in most settings (e.g. 125M, 8 GPUs, DP 4 x PP 2:
26.4 vs 26.8 on Reddit), and an outer sync that does not grow with the number of replicas.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default=str(ROOT / "shoal" / "runs" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2])
    parser.add_argument(
        "--modes", nargs="+", default=["none", "noloco", "diloco"], choices=["none", "noloco", "diloco"]
    )
    parser.add_argument(
        "--routing",
        default="random",
        choices=["random", "gwtf", "auto"],
        help="the data node's routing in every arm (auto: each mode's daemon default, GWTF unless NoLoCo)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    base = load_run_config(args.run_config).replace({"train.steps": args.steps})
    runs = []
    with tempfile.TemporaryDirectory(prefix="shoal-averaging-") as tmp:
        for replicas in args.replicas:
            for mode in args.modes:
                if mode == "none" and replicas != args.replicas[0]:
                    continue  # the no-averaging baseline once, at the first replica count
                workdir = Path(tmp) / f"{mode}-{replicas}"
                workdir.mkdir()
                run_file = workdir / "run.toml"
                run_file.write_text(base.replace(averaging_overrides(mode)).to_toml())
                print(f"{mode}, {replicas} replicas per stage ...", file=sys.stderr, flush=True)
                runs.append(run_swarm(run_file, workdir, replicas, args.routing, args.timeout))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "losses"}), file=sys.stderr, flush=True)
    assert len({r["steps"] for r in runs}) == 1, "every swarm must train the same steps"
    result = {
        "command": "python benchmarks/averaging.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "inner_steps": base.averaging.inner_steps,
        "routing": args.routing,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
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
