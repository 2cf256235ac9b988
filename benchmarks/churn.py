"""Churn: a real local swarm under a seeded kill -9 / restart schedule, against the same run without faults.

    .venv/bin/python benchmarks/churn.py                      # 250 steps per run, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/churn.py --steps 60 --seed 1  # a quick look

Both runs: a bootstrap peer, 2 stage workers per block stage and one data node as processes on
loopback, 1 torch thread each, the same run, steps and data. In the churn run a random live worker
is killed with SIGKILL every 12-20 s (seeded) and a fresh `shoal node` is started 2 s later (it takes
the stage that is short). Reported for each run: microbatches injected / completed / abandoned (by
reason) / sent again, hops redone, stream retries, loss curve, tokens/s over time; and the ratio
of the churn run's throughput to the fault-free run's. Writes benchmarks/results/churn.json and its
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section

from shoal.config import load_run_config
from shoal.demo.launcher import LocalSwarm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "churn.json"
TTL = "6"
HEADER = (
    "| run | injected | completed | abandoned (reasons) | sent again | hops redone | stream retries | kills "
    "| final loss | val loss | tokens/s | wall s |\n|" + "---|" * 12
)


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _done(path: Path) -> dict | None:
    return next((e for e in _events(path) if e["event"] == "done"), None)


def run_swarm(run_file: Path, workdir: Path, replicas: int, churn: bool, seed: int, timeout_s: float) -> dict:
    run = load_run_config(str(run_file))
    swarm = LocalSwarm(workdir, log_level="INFO")
    rng = random.Random(seed)
    kills: list[dict] = []
    stats_files: list[Path] = []
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]

        def start_worker(*extra: str, wait: bool = False):
            stats = workdir / f"worker-{len(stats_files)}.json"
            stats_files.append(stats)
            args = ("--role", "worker", "--record-ttl", TTL, "--threads", "1", "--stats-file", str(stats), *extra)
            return swarm.start_node([entry], *args, wait=wait)

        workers = [start_worker("--stage", str(s)) for s in range(1, run.pipeline.stages) for _ in range(replicas)]
        for worker in workers:
            swarm.wait_ready(worker)
        progress = workdir / "progress.jsonl"
        data_stats = workdir / "data.json"
        swarm.start_node(
            [entry], "--role", "data", "--record-ttl", TTL, "--threads", "1",
            "--progress-file", str(progress), "--stats-file", str(data_stats),
        )  # fmt: skip
        started = time.monotonic()
        next_kill = started + rng.uniform(12, 20)
        while _done(progress) is None:
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the run did not finish in {timeout_s:.0f} s")
            if churn and time.monotonic() >= next_kill:
                alive = [w for w in workers if w.alive]
                victim = rng.choice(alive)
                steps = [e["step"] for e in _events(progress) if e["event"] == "step"]
                swarm.kill(victim)
                kills.append(
                    {
                        "at_s": round(time.monotonic() - started, 1),
                        "step": steps[-1] if steps else -1,
                        "stage": victim.stage,
                        "peer_id": victim.peer_id,
                    }
                )
                time.sleep(2.0)
                workers.append(start_worker())  # no --stage: it must find the stage that is short
                next_kill = time.monotonic() + rng.uniform(12, 20)
            time.sleep(0.2)
        wall_s = time.monotonic() - started
        for worker in workers:
            if worker.alive:
                swarm.stop(worker)
        swarm.close()
    finally:
        swarm.close(timeout_s=0)
    done = _done(progress)
    steps = [e for e in _events(progress) if e["event"] == "step"]
    worker_stats = [json.loads(p.read_text())["engine"] for p in stats_files if p.exists()]
    return {
        "replicas_per_stage": replicas,
        "churn": churn,
        "wall_s": round(wall_s, 1),
        "done": done,
        "kills": kills,
        "waiting_events": sum(1 for e in _events(progress) if e["event"] == "waiting"),
        "hops_redone": sum(s.get("recomputed", 0) for s in worker_stats),
        "redo_seconds": round(sum(s.get("recompute_s", 0.0) for s in worker_stats), 2),
        "stream_retries": sum(s.get("stream_retries", 0) for s in worker_stats),
        "workers_reporting": len(worker_stats),
        "loss": [[e["step"], e["loss"]] for e in steps],
        "tokens_per_s": [[round(e["elapsed_s"], 1), round(e["tokens_per_s"], 1)] for e in steps],
        "train_tokens_per_s": done["tokens_per_s"] if done else None,
    }


def markdown(result: dict) -> str:
    rows = []
    for name in ("no_faults", "churn"):
        r = result[name]
        d = r["done"]
        reasons = ", ".join(f"{k}: {v}" for k, v in d["abandoned_reasons"].items()) or "none"
        rows.append(
            f"| {name.replace('_', ' ')} | {d['microbatches_injected']} | {d['microbatches_completed']} | "
            f"{d['microbatches_abandoned']} ({reasons}) | {d['microbatches_resent']} | {r['hops_redone']} | "
            f"{r['stream_retries']} | {len(r['kills'])} | {d['final_loss']:.3f} | {d['val_loss']:.3f} | "
            f"{d['tokens_per_s']:.0f} | {r['wall_s']:.0f} |"
        )
    return f"""## Churn: kill -9 and restart under load, against the same run without faults

`{result["command"]}` ({result["steps"]} steps per run, {result["replicas"]} replicas per block stage,
seed {result["seed"]}; a worker SIGKILLed every 12-20 s and a fresh node started 2 s later; record
TTL {TTL} s). Hops redone and stream retries are counted by workers that shut down cleanly (killed
ones take their counters with them).

{HEADER}
{chr(10).join(rows)}

Throughput under churn / without faults: **{result["throughput_ratio"]:.2f}**. Routing in the daemon is
still capacity-weighted replica choice; GWTF and SWARM routing in real daemons are not built yet, so
the paper's GWTF-vs-SWARM comparison is only in the simulator (see the scheduling section; the paper
reports GWTF up to 45 % faster than SWARM under high churn).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default=str(ROOT / "shoal" / "runs" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-churn-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run_file.write_text(load_run_config(args.run_config).replace({"train.steps": args.steps}).to_toml())
        results = {}
        for name, churn in (("no_faults", False), ("churn", True)):
            (workdir / name).mkdir()
            print(f"{name}: {args.steps} steps ...", file=sys.stderr, flush=True)
            results[name] = run_swarm(run_file, workdir / name, args.replicas, churn, args.seed, args.timeout)
            print(json.dumps(results[name]["done"]), file=sys.stderr, flush=True)
    same = [results[n]["done"]["steps"] for n in results]
    assert same[0] == same[1] == args.steps, f"runs must train the same steps: {same}"
    ratio = results["churn"]["train_tokens_per_s"] / results["no_faults"]["train_tokens_per_s"]
    result = {
        "command": "python benchmarks/churn.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "replicas": args.replicas,
        "seed": args.seed,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "throughput_ratio": round(ratio, 3),
        "loss_gap_final": round(results["churn"]["done"]["final_loss"] - results["no_faults"]["done"]["final_loss"], 4),
        "median_step_tokens_per_s": {n: statistics.median(t for _, t in results[n]["tokens_per_s"]) for n in results},
        **results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if not args.no_docs:
        write_section("churn", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
