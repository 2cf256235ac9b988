"""SkipPipe's shared timetable on real daemons: collisions per step with it and without, beside the
simulator's figure for the same swarm.

    .venv/bin/python benchmarks/skippipe_timetable.py              # 2 arms x 2 repeats, ~6 min
    .venv/bin/python benchmarks/skippipe_timetable.py --repeats 1 --no-docs

Real daemons on loopback: the bundled `tiny` run (d 128, 4 layers) cut into 4 stages (3 block stages of 2 workers
each) and 2 data nodes, every one `--paths skippipe --skip 0.33` (each path visits 2 of the 3 block
stages). Arms: `timetable` (`[skippipe] timetable = true`, the default: every data node computes the
step's plan for both from the same advertised swarm, seeded by run and step, releases its microbatches
at the planned times, and every hop waits for its planned start) and `alone` (each data node plans
its own paths over the workers as if it were the only one, and sends them at once: the daemon before
the timetable). Both run the
jump cap (3) and the full pass every 10th step.

Measured: a collision is a microbatch's forward or backward that arrived at a worker while the
worker's compute thread was busy with another job (`shoal.node.compute`); the workers' counts are
summed and divided by the steps (the end-of-run evaluation, one full-path batch per data node, is in
both arms' counts). Also the share of steps at which the two data nodes' plan digests agreed, step
time, and every abandoned microbatch. The simulator (`shoal.sim.replay`) replays, over the swarm the
first data node planned over at its first step, the shared plan (no task before its planned time: the
paper's model, and what the `timetable` arm does), the same plan with its release times only (hops in
arrival order), and each data node's own plan, sent at once (the `alone` arm). Writes
benchmarks/results/skippipe_timetable.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.config import run_config_from_dict
from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until
from shoal.node.engines import run_cost_model
from shoal.planning.plan import IterationPlan
from shoal.planning.skippipe import SkipPipeOptions, plan_skippipe
from shoal.run_files import load_run_config
from shoal.sim.replay import releases_only, simulate_plan, swarm_from_dict

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "skippipe_timetable.json"
SKIP = 0.33
DATA_NODES = 2
ARMS = {"timetable": True, "alone": False}


def run_arm(workdir: Path, timetable: bool, steps: int, timeout_s: float) -> dict:
    run = load_run_config("tiny").replace({
        "pipeline.stages": 4, "train.steps": steps, "train.eval_batches": 1, "skippipe.timetable": timetable,
    })  # fmt: skip
    run_file = workdir / "run.toml"
    run_file.write_text(run.to_toml())
    swarm = LocalSwarm(workdir, log_level="INFO")
    progress = [workdir / f"progress-{k}.jsonl" for k in range(DATA_NODES)]
    stats = [workdir / f"worker-{i}.json" for i in range(2 * (run.pipeline.stages - 1))]
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = [swarm.start_node([entry], "--role", "worker", "--stage", str(1 + i // 2), "--stats-file",
                                    str(path), wait=False) for i, path in enumerate(stats)]  # fmt: skip
        for worker in workers:
            swarm.wait_ready(worker)
        nodes = [swarm.start_node([entry], "--role", "data", "--data-shard", f"{k}/{DATA_NODES}", "--paths",
                                  "skippipe", "--skip", str(SKIP), "--progress-file", str(progress[k]), wait=False)
                 for k in range(DATA_NODES)]  # fmt: skip
        done = [wait_until(lambda p=p: done_event(p), timeout_s, f"data node {p.stem}") for p in progress]
        for node in (*nodes, *workers):
            swarm.stop(node)
    finally:
        swarm.close(timeout_s=5)
    engines = [json.loads(path.read_text())["engine"] for path in stats]
    events = [progress_events(p) for p in progress]
    step_events = [[e for e in ev if e["event"] == "step"] for ev in events]
    digests = [{e["step"]: e.get("plan") for e in ev} for ev in step_events]
    planned = [s for s in digests[0] if digests[0][s] and not step_events[0][s]["full_pass"]]
    agreed = sum(1 for s in planned if all(d.get(s) == digests[0][s] for d in digests))
    swarms = [e for e in events[0] if e["event"] == "planned_over"]
    collisions = sum(e["collisions"] for e in engines)
    return {
        "timetable": timetable,
        "steps": steps,
        "collisions": collisions,
        "collisions_per_step": collisions / steps,
        "collision_s_per_step": sum(e["collision_s"] for e in engines) / steps,
        "forwards": sum(e["forwards"] for e in engines),
        "plans_agreed": agreed if timetable else None,
        "steps_planned": len(planned),
        "full_passes": sum(1 for e in step_events[0] if e.get("full_pass")),
        "step_s": statistics.median(e["step_s"] for ev in step_events for e in ev),
        "abandoned": sum(d["microbatches_abandoned"] for d in done),
        "val_loss": [d["val_loss"] for d in done],
        "planned_over": swarms[0] if swarms else None,
        "run": run.to_dict(),
    }


def predicted(planned_over: dict, run_data: dict) -> dict:
    """The simulator's collisions for the step a data node reported what it planned over: its shared
    plan remade as `step_timetable` made it (same swarm, options and seed), and each one's own."""
    run = run_config_from_dict(run_data)
    cost, microbatches = run_cost_model(run), run.microbatches_per_step
    swarm = swarm_from_dict(planned_over["swarm"])
    options = SkipPipeOptions(skip=SKIP, max_jump=run.skippipe.max_jump or None, search_budget=4 * microbatches)
    seed = random.Random(f"skippipe:{run.run_id}:{planned_over['step']}")
    plan = plan_skippipe(swarm, cost, microbatches * len(swarm.data_nodes), options, seed)
    routes = []
    for data in swarm.data_nodes:
        mine = swarm.with_nodes(tuple(n for n in swarm.nodes if n.stage > 0 or n.node_id == data.node_id))
        routes += plan_skippipe(mine, cost, microbatches, options, random.Random(f"alone:{data.node_id}")).routes
    alone = IterationPlan("alone", swarm, tuple(routes), None)
    out = {}
    for name, replayed in (("timetable", plan), ("releases only", releases_only(plan)), ("alone", alone)):
        result = simulate_plan(replayed, cost)
        out[name] = {"collisions": result.collisions, "collision_s": result.collision_s,
                     "makespan_s": result.makespan_s, "abandoned": result.abandoned}  # fmt: skip
    return out


def markdown(doc: dict) -> str:
    s = doc["setting"]
    lines = [
        "# SkipPipe's timetable across data nodes: collisions per step on daemons and in the simulator",
        "",
        f"`{s['command']}` ({wall_time(s['seconds'])}; {s['machine']}). The bundled `tiny` run in 4 stages (3 "
        f"block stages of 2 workers each, 2 data nodes), {s['steps']} steps, every data node `--paths skippipe "
        f"--skip {SKIP}` (2 of 3 block stages per path), jump cap 3, a full pass every 10th step. `timetable`: "
        "every data node computes the step's plan for both, releases its microbatches at the planned times and "
        "every hop waits for its planned start (the default); `alone`: each plans its own paths as if alone and "
        "sends them at once. A collision is a "
        "microbatch's forward or backward that reached a worker busy with another job (summed over workers, "
        "per step; the end-of-run evaluation is in both). The simulator replays one step over the swarm the "
        "first data node planned over: the shared plan as the paper runs it and the `timetable` arm does (no task "
        "before its planned time), the same plan with only its releases, and each data node's own plan.",
        "",
        "| arm | repeat | collisions per step (daemons) | waiting per step (s) | plans agreed | median step (s) "
        "| abandoned | val loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        agreed = "-" if r["plans_agreed"] is None else f"{r['plans_agreed']} of {r['steps_planned']}"
        lines.append(
            f"| {r['arm']} | {r['repeat']} | {r['collisions_per_step']:.1f} | {r['collision_s_per_step']:.3f} "
            f"| {agreed} | {r['step_s']:.2f} | {r['abandoned']} | {' / '.join(f'{v:.3f}' for v in r['val_loss'])} |"
        )
    medians = {arm: statistics.median(r["collisions_per_step"] for r in doc["runs"] if r["arm"] == arm)
               for arm in ARMS if any(r["arm"] == arm for r in doc["runs"])}  # fmt: skip
    lines += ["", "Simulator, one step over the swarm each run planned over (collisions on block-stage nodes):", ""]
    lines += ["| run | shared plan, timed | shared plan, releases only | each alone |", "|---|---|---|---|"]
    for r in doc["runs"]:
        p = r.get("predicted")
        if p:
            lines.append(f"| {r['arm']} {r['repeat']} | {p['timetable']['collisions']} | "
                         f"{p['releases only']['collisions']} | {p['alone']['collisions']} |")  # fmt: skip
    if len(medians) == 2:
        ratio = medians["timetable"] / max(medians["alone"], 1e-9)
        lines += ["", f"Median collisions per step on daemons: timetable {medians['timetable']:.1f}, alone "
                      f"{medians['alone']:.1f} (ratio {ratio:.2f})."]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    runs = []
    for repeat in range(args.repeats):
        for arm in args.arms:  # interleaved: the machine's load falls on both arms alike
            with tempfile.TemporaryDirectory(prefix="shoal-timetable-") as work:
                result = run_arm(Path(work), ARMS[arm], args.steps, args.timeout)
            if result["planned_over"] is not None:
                result["predicted"] = predicted(result["planned_over"], result["run"])
            result.pop("run")
            runs.append({"arm": arm, "repeat": repeat, **result})
            p = result.get("predicted") or {}
            print(f"{arm} {repeat}: {result['collisions_per_step']:.1f} collisions per step, plans agreed "
                  f"{result['plans_agreed']}, abandoned {result['abandoned']}; simulator "
                  f"{ {k: v['collisions'] for k, v in p.items()} }", flush=True)  # fmt: skip
    doc = {
        "setting": {
            "steps": args.steps,
            "repeats": args.repeats,
            "seconds": time.perf_counter() - began,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "command": shlex.join([".venv/bin/python", "benchmarks/skippipe_timetable.py", *argv]),
        },
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    if not args.no_docs:
        write_section("skippipe-timetable", markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
