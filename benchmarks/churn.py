"""Churn: a real local swarm under a seeded kill -9 / restart schedule, against the same run without faults.

    .venv/bin/python benchmarks/churn.py                      # 250 steps per run, ~20 minutes on 2 cores
    .venv/bin/python benchmarks/churn.py --steps 60 --seed 1  # a quick look

Four runs of the same run, steps and data, each a bootstrap peer, stage workers and one data node as
processes on loopback, 1 torch thread each: without faults with 1 and with 2 replicas per block
stage, then 2 replicas under churn once with GWTF routing and once with SWARM routing, on the same
seeded schedule: a random live worker is killed with SIGKILL every 12-20 s and a fresh `shoal node`
is started 2 s later (it must find the stage that is short). Reported for each run: microbatches
injected / completed / abandoned (by reason) / sent again, hops redone, stream retries, where each
replacement went, loss curve, tokens/s over time; and throughput ratios between the runs.
Writes benchmarks/results/churn.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section

from shoal.demo.launcher import LocalSwarm, done_event, progress_events
from shoal.run_files import FULL_PRECISION, load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "churn.json"
# this benchmark's previous run (250 steps, seed 0): tokens/s under churn / without faults, and GWTF / SWARM
PREVIOUS = {"commit": "50ebce0", "gwtf": 0.881, "swarm": 0.500, "ratio": 1.762}
TTL = "6"
HEADER = (
    "| run | injected | completed | abandoned (reasons) | sent again | resumed | recoveries | hops redone "
    "| stream retries | kills (n) | final loss | val loss | tokens/s | wall s |\n|" + "---|" * 14
)


def _stage_of(peer) -> int | None:
    """A peer's stage from its ready file (None until it is active)."""
    if peer.stage is None and peer.ready_file is not None and peer.ready_file.exists():
        peer.stage = json.loads(peer.ready_file.read_text())["stage"]
    return peer.stage


def run_swarm(
    run_file: Path, workdir: Path, replicas: int, churn: bool, routing: str, seed: int, timeout_s: float
) -> dict:
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
            args = ("--role", "worker", "--record-ttl", TTL, "--threads", "1", "--routing", routing,
                    "--stats-file", str(stats), *extra)  # fmt: skip
            return swarm.start_node([entry], *args, wait=wait)

        workers = [start_worker("--stage", str(s)) for s in range(1, run.pipeline.stages) for _ in range(replicas)]
        for worker in workers:
            swarm.wait_ready(worker)
        progress = workdir / "progress.jsonl"
        data_stats = workdir / "data.json"
        swarm.start_node(
            [entry], "--role", "data", "--record-ttl", TTL, "--threads", "1", "--routing", routing,
            "--progress-file", str(progress), "--stats-file", str(data_stats),
        )  # fmt: skip
        started = time.monotonic()
        next_kill = started + rng.uniform(12, 20)
        while done_event(progress) is None:
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the run did not finish in {timeout_s:.0f} s")
            if churn and time.monotonic() >= next_kill:
                alive = [w for w in workers if w.alive]
                victim = rng.choice(alive)
                steps = [e["step"] for e in progress_events(progress) if e["event"] == "step"]
                swarm.kill(victim)
                kill = {"at_s": round(time.monotonic() - started, 1), "step": steps[-1] if steps else -1}
                kill["stage"] = _stage_of(victim)
                time.sleep(2.0)
                kill["replacement"] = start_worker()  # no --stage: it must find the stage that is short
                workers.append(kill["replacement"])
                kills.append(kill)
                next_kill = time.monotonic() + rng.uniform(12, 20)
            time.sleep(0.2)
        wall_s = time.monotonic() - started
        for kill in kills:
            kill["replacement_stage"] = _stage_of(kill.pop("replacement"))
        for worker in workers:
            if worker.alive:
                swarm.stop(worker)
        swarm.close()
    finally:
        swarm.close(timeout_s=0)
    done = done_event(progress)
    steps = [e for e in progress_events(progress) if e["event"] == "step"]
    worker_stats = [json.loads(p.read_text())["engine"] for p in stats_files if p.exists()]
    return {
        "replicas_per_stage": replicas,
        "churn": churn,
        "routing": routing,
        "replacements_on_the_killed_stage": sum(k["replacement_stage"] == k["stage"] for k in kills),
        "wall_s": round(wall_s, 1),
        "done": done,
        "kills": kills,
        "waiting_events": sum(1 for e in progress_events(progress) if e["event"] == "waiting"),
        "hops_redone": sum(s.get("recomputed", 0) for s in worker_stats),
        "recomputes_delegated": sum(s.get("recomputes_delegated", 0) for s in worker_stats),
        "redo_seconds": round(sum(s.get("recompute_s", 0.0) for s in worker_stats), 2),
        "stream_retries": sum(s.get("stream_retries", 0) for s in worker_stats),
        "workers_reporting": len(worker_stats),
        "loss": [[e["step"], e["loss"]] for e in steps],
        "tokens_per_s": [[round(e["elapsed_s"], 1), round(e["tokens_per_s"], 1)] for e in steps],
        "train_tokens_per_s": done["tokens_per_s"] if done else None,
    }


LOOPBACK_LATENCY_S = 0.0005  # one way, between processes on this machine
LOOPBACK_BANDWIDTH_BPS = 200e6  # a libp2p stream on loopback (hivemind-notes: 209-250 MB/s)
JOIN_WARMUP_S = 8.0  # a restarted `shoal node` is active about 6.6 s after it starts (join benchmark), + 2 s


def _sim_swarm(run, forward_s: float, replicas: int):
    from shoal.planning.swarm import PlanNode, Swarm

    nodes = [PlanNode(0, 0, 0, forward_s, 64)]
    for stage in range(1, run.pipeline.stages):
        for _ in range(replicas):
            nodes.append(PlanNode(len(nodes), stage, 0, forward_s, 64))
    return Swarm(tuple(nodes), run.pipeline.stages, ((LOOPBACK_LATENCY_S,),), ((LOOPBACK_BANDWIDTH_BPS,),))


def _simulate(run, forward_s: float, replicas: int, microbatches: int, policy: str, kills: list[dict]):
    import random

    from shoal.planning.costs import CostModel
    from shoal.planning.policy import make_policy
    from shoal.planning.swarm import PlanNode
    from shoal.protocol.tensors import DTYPE_SIZES
    from shoal.sim.engine import SimConfig, Simulator

    t = run.train
    cost = CostModel(activation_bytes=t.microbatch_size * t.seq_len * run.model.d_model * DTYPE_SIZES["float32"])
    scripted = []
    for kill in kills:
        if kill["stage"]:
            scripted.append((kill["at_s"], "crash-stage", kill["stage"]))
            scripted.append((kill["at_s"] + 2.0, "join", 0))
    config = SimConfig(microbatches=microbatches, failure_timeout_s=float(TTL), join_warmup_s=JOIN_WARMUP_S,
                       scripted=tuple(sorted(scripted)))  # fmt: skip
    swarm = _sim_swarm(run, forward_s, replicas)
    spawn = lambda node_id, rng: PlanNode(node_id, 1, 0, forward_s, 64)  # noqa: E731
    sim = Simulator(swarm, cost, make_policy(policy, cost, random.Random(0)), config, random.Random(0), spawn)
    return sim.run()


def predicted(run_file: Path, result: dict) -> dict:
    """The simulator's prediction for the same kill schedule (crashes of a node of the killed stage at
    the same seconds, a join 2 s later), with GWTF and with SWARM. Its per-node compute is calibrated
    so that its fault-free run matches the measured fault-free throughput; links are loopback's."""
    run = load_run_config(str(run_file))
    runs = result["runs"]
    measured = runs["no faults"]["train_tokens_per_s"] / (run.train.microbatch_size * run.train.seq_len)
    microbatches = runs["no faults"]["done"]["microbatches_completed"]
    forward_s = 0.1
    for _ in range(3):  # calibrate: throughput scales as 1 / compute time
        free = _simulate(run, forward_s, 2, microbatches, "gwtf", [])
        forward_s *= free.throughput_mb_per_s / measured
    out = {"forward_s": round(forward_s, 4), "measured_mb_per_s": round(measured, 3)}
    for name, policy in (("churn, GWTF", "gwtf"), ("churn, SWARM", "swarm")):
        sim = _simulate(run, forward_s, 2, microbatches, policy, runs[name]["kills"])
        out[name] = {
            "completed": sim.completed, "abandoned": sim.abandoned, "hops redone": sim.recomputed_hops,
            "sent again": sim.restarted, "mb_per_s": round(sim.throughput_mb_per_s, 3),
            "over_no_faults": round(sim.throughput_mb_per_s / free.throughput_mb_per_s, 3),
        }  # fmt: skip
    return out


RUNS = (  # name, replicas per block stage, churn, routing
    ("no faults, 1 replica", 1, False, "gwtf"),
    ("no faults", 2, False, "gwtf"),
    ("churn, GWTF", 2, True, "gwtf"),
    ("churn, SWARM", 2, True, "swarm"),
)


def markdown(result: dict) -> str:
    rows = []
    for name, *_ in RUNS:
        r = result["runs"][name]
        d = r["done"]
        reasons = ", ".join(f"{k}: {v}" for k, v in d["abandoned_reasons"].items()) or "none"
        kills = f"{len(r['kills'])} ({r['replacements_on_the_killed_stage']})" if r["churn"] else "0"
        rows.append(
            f"| {name} | {d['microbatches_injected']} | {d['microbatches_completed']} | "
            f"{d['microbatches_abandoned']} ({reasons}) | {d['microbatches_resent']} | "
            f"{d.get('microbatches_resumed', '-')} | {d['backward_recoveries']} | "
            f"{r['hops_redone']} | {r['stream_retries']} | {kills} | {d['final_loss']:.3f} | {d['val_loss']:.3f} | "
            f"{d['tokens_per_s']:.0f} | {r['wall_s']:.0f} |"
        )
    ratios = result["throughput_ratios"]
    sim = result["simulator"]
    sim_rows = "\n".join(
        f"| {name} | {sim[name]['completed']} | {sim[name]['abandoned']} | {sim[name]['sent again']} | "
        f"{sim[name]['hops redone']} | {sim[name]['over_no_faults']:.2f} |"
        for name in ("churn, GWTF", "churn, SWARM")
    )
    return f"""# Churn: kill -9 and restart under load, against the same run without faults

`{result["command"]}` ({result["steps"]} steps per run, seed {result["seed"]}; in the churn runs a
random live worker is SIGKILLed every 12-20 s on the same seeded schedule and a fresh `shoal node`
(no `--stage`) is started 2 s later; record TTL {TTL} s; 1 torch thread per process on 2 shared
cores). "kills (n)": n replacements took the stage of the node just killed. "hops redone" and
"stream retries" count what workers that shut down cleanly report (killed ones take their
counters with them); "recoveries" is the data node's count of lost backward hops it had redone.

{HEADER}
{chr(10).join(rows)}

The simulator's prediction for the same schedule (a node of the killed stage crashes at the same
second, a node joins 2 s later and serves {JOIN_WARMUP_S:.0f} s after that; per-node compute
calibrated to the fault-free run, {sim["forward_s"] * 1e3:.0f} ms forward per stage; loopback links):

| simulated run | completed | abandoned | sent again | hops redone | throughput / no faults |
|---|---|---|---|---|---|
{sim_rows}

"sent again": forward passes restarted from the data node; "resumed": forward passes lost at a hop
that had taken the activation, passed on again by the nearest hop upstream that kept it (as the
simulator does; a hop lost before it acknowledged is re-routed by its sender and counts in neither).
The simulator is far more optimistic on throughput: it does not model what a
restart costs on two shared cores (a fresh `shoal node` imports torch, starts its libp2p daemon
and measures its own speed, seconds of CPU taken from the running workers), nor a data node
waiting for a stage whose replicas died together.

Throughput (tokens/s over training) under churn / without faults: GWTF **{ratios["gwtf_churn_over_no_faults"]:.2f}**,
SWARM **{ratios["swarm_churn_over_no_faults"]:.2f}**; GWTF / SWARM under churn **{ratios["gwtf_over_swarm_churn"]:.2f}**
(one run each: read it as a direction, not a median). The run before, at {PREVIOUS["commit"]}, when GWTF was
a central plan per data node and a hop-by-hop sender's choice was unknown to its data node (so SWARM could
resume a lost forward only where the data node had guessed the hop): GWTF {PREVIOUS["gwtf"]:.2f}, SWARM
{PREVIOUS["swarm"]:.2f}, GWTF / SWARM {PREVIOUS["ratio"]:.2f}. The paper (gwtf.md) reports GWTF up to 45 % faster
than SWARM under high churn, on simulated swarms of tens of nodes; this is four workers and a data node on loopback,
where every link is alike and the difference between the policies is mostly which replica a hop is
redone on.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default=str(ROOT / "shoal" / "runs" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="recompute the simulator's prediction for the runs in the results file",
    )
    args = parser.parse_args()
    if args.predict_only:
        result = json.loads(RESULTS.read_text())
        run_file = Path(tempfile.mkdtemp(prefix="shoal-churn-")) / "run.toml"
        run = load_run_config(args.run_config).replace({**FULL_PRECISION, "train.steps": result["steps"]})
        run_file.write_text(run.to_toml())
        result["simulator"] = predicted(run_file, result)
        RESULTS.write_text(json.dumps(result, indent=1))
        if not args.no_docs:
            write_section("churn", markdown(result))
        print(markdown(result))
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="shoal-churn-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run = load_run_config(args.run_config).replace({**FULL_PRECISION, "train.steps": args.steps})
        run_file.write_text(run.to_toml())
        for i, (name, replicas, churn, routing) in enumerate(RUNS):
            (workdir / str(i)).mkdir()
            print(f"{name}: {args.steps} steps ...", file=sys.stderr, flush=True)
            results[name] = run_swarm(run_file, workdir / str(i), replicas, churn, routing, args.seed, args.timeout)
            print(json.dumps(results[name]["done"]), file=sys.stderr, flush=True)
        prediction = predicted(run_file, {"runs": results})
    steps = {results[n]["done"]["steps"] for n in results}
    assert steps == {args.steps}, f"runs must train the same steps: {steps}"
    speed = {n: results[n]["train_tokens_per_s"] for n in results}
    result = {
        "command": "python benchmarks/churn.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "throughput_ratios": {
            "gwtf_churn_over_no_faults": round(speed["churn, GWTF"] / speed["no faults"], 3),
            "swarm_churn_over_no_faults": round(speed["churn, SWARM"] / speed["no faults"], 3),
            "gwtf_over_swarm_churn": round(speed["churn, GWTF"] / speed["churn, SWARM"], 3),
        },
        "median_step_tokens_per_s": {n: statistics.median(t for _, t in results[n]["tokens_per_s"]) for n in results},
        "simulator": prediction,
        "runs": results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    if not args.no_docs:
        write_section("churn", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
