"""Scheduling benchmark: SkipPipe vs DT-FM at the paper's setting, GWTF vs SWARM under churn, and the
SkipPipe planner's wall time as the swarm grows. Everything runs in the simulator (virtual time);
only `scheduler_wall_s` is wall-clock.

    .venv/bin/python benchmarks/scheduling.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/scheduling.py --quick    # one seed, smaller runs (a smoke test)

Writes benchmarks/results/scheduling.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from docs_section import write_section

from shoal.planning.skippipe import SkipPipeOptions, plan_skippipe
from shoal.sim.generator import ACCESS_GIBPS_RANGE, MEMORY_RANGE, SPEED_RANGE
from shoal.sim.run import RunSpec, build_swarm, simulate
from shoal.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "scheduling.json"

GCP12_POLICIES = (("dtfm", True), ("random-skip", True), ("skippipe", False), ("skippipe", True))
AUTHORS_RULES = {"max_swaps": 2, "max_jump": 4}  # arXiv code: <= 2 adjacent swaps, jumps <= 4 stages
CHURN_LEVELS = {"none": 0.0, "low": 0.33, "high": 2.0}  # crash + leave events per node per hour
CHURN_SWARM = {"nodes": 30, "stages": 6, "microbatches": 300}
SCALE_NODES = (20, 100, 1000, 5000)
SCALE_STAGES = 8


def label(policy: str, aware: bool) -> str:
    return policy if aware or policy != "skippipe" else "skippipe-nocollision"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def gcp12(seeds: list[int], fixed_link: bool) -> dict:
    """Iteration time of each policy at the paper's setting, one run per seed (allocation, draws)."""
    network = load_scenario("gcp12")
    if fixed_link:
        network = network.with_bandwidth("NL", "London", 0.2368)
    runs: dict[str, list[dict]] = {}
    for seed in seeds:
        for policy, aware in GCP12_POLICIES:
            spec = RunSpec(policy=policy, collision_aware=aware, seed=seed, network=network, **AUTHORS_RULES)
            result = simulate(spec)
            assert result.completed == 30, result
            runs.setdefault(label(policy, aware), []).append(result.to_dict())
    out = {"runs": runs, "makespan_s": {}, "ratio_to_dtfm": {}}
    for name, results in runs.items():
        out["makespan_s"][name] = summary([r["makespan_s"] for r in results])
        out["ratio_to_dtfm"][name] = summary(
            [r["makespan_s"] / d["makespan_s"] for r, d in zip(results, runs["dtfm"], strict=True)]
        )
    # Unloaded round trips: one microbatch per DT-FM pipeline, one per SkipPipe data node. With memory
    # for 3 in flight, DT-FM needs 10/3 round trips per pipeline and SkipPipe 6/3, which puts a
    # no-queueing estimate of the ratio at 2 x RT_skip / (10/3 x RT_full).
    estimates = []
    for seed in seeds:
        full = simulate(RunSpec(policy="dtfm", microbatches=3, seed=seed, network=network, **AUTHORS_RULES))
        part = simulate(RunSpec(policy="skippipe", microbatches=5, seed=seed, network=network, **AUTHORS_RULES))
        estimates.append(2 * part.makespan_s / (10 / 3 * full.makespan_s))
    out["unloaded_round_trip_estimate"] = summary(estimates)
    sp, nc = runs["skippipe"], runs["skippipe-nocollision"]
    out["collision_avoidance_gain"] = summary([a["makespan_s"] / b["makespan_s"] for a, b in zip(sp, nc, strict=True)])
    out["scheduler_wall_s"] = {
        "skippipe_total": summary([r["scheduler_wall_s"] for r in sp]),
        "skippipe_paths_only": summary([r["scheduler_wall_by_call"]["plan_skippipe"] for r in sp]),
        "allocation_only": summary([r["scheduler_wall_by_call"]["allocate_stages"] for r in sp]),
    }
    return out


def scale(nodes_list: tuple[int, ...]) -> list[dict]:
    """Wall time of SkipPipe's collision-aware path planning alone on random heterogeneous swarms."""
    rows = []
    for nodes in nodes_list:
        scenario, swarm = build_swarm(RunSpec(scenario="random", nodes=nodes, stages=SCALE_STAGES, seed=0))
        microbatches = 6 * len(swarm.data_nodes)  # six per data node, as at the paper's setting
        options = SkipPipeOptions(skip=0.33, **AUTHORS_RULES)
        start = time.perf_counter()
        plan = plan_skippipe(swarm, scenario.cost_model(), microbatches, options, random.Random(0))
        wall = time.perf_counter() - start
        rows.append(
            {
                "nodes": nodes,
                "stages": SCALE_STAGES,
                "data_nodes": len(swarm.data_nodes),
                "microbatches": microbatches,
                "plans_searched": max(1, options.search_budget // microbatches),
                "wall_s": wall,
                "predicted_makespan_s": plan.predicted_makespan_s,
            }
        )
        print(f"  scale {nodes:>5} nodes: {wall:.2f} s", file=sys.stderr)
    return rows


def churn(seeds: list[int], microbatches: int) -> dict:
    """GWTF against SWARM: time to N completed microbatches, throughput and waste, per churn level."""
    out: dict = {}
    for hetero in (False, True):
        for level, rate in CHURN_LEVELS.items():
            key = f"{'heterogeneous' if hetero else 'homogeneous'}/{level}"
            per_policy: dict[str, list[dict]] = {}
            for seed in seeds:
                for policy in ("swarm", "gwtf"):
                    spec = RunSpec(
                        scenario="random",
                        policy=policy,
                        nodes=CHURN_SWARM["nodes"],
                        stages=CHURN_SWARM["stages"],
                        microbatches=microbatches,
                        churn=rate,
                        seed=seed,
                        heterogeneous=hetero,
                    )
                    result = simulate(spec)
                    assert result.completed + result.abandoned == result.injected
                    per_policy.setdefault(policy, []).append(result.to_dict())
            sw, gw = per_policy["swarm"], per_policy["gwtf"]
            cell = {"churn_per_node_hour": rate, "runs": per_policy}
            for name, runs in per_policy.items():
                cell[name] = {
                    "time_to_n_s": summary([r["makespan_s"] for r in runs]),
                    "throughput_mb_per_s": summary([r["throughput_mb_per_s"] for r in runs]),
                    "wasted_compute_s": summary([r["wasted_compute_s"] for r in runs]),
                    "abandoned": summary([r["abandoned"] for r in runs]),
                    "restarted": summary([r["restarted"] for r in runs]),
                    "recomputed_hops": summary([r["recomputed_hops"] for r in runs]),
                    "crashes": summary([r["churn"].get("crashes", 0) for r in runs]),
                }
            pairs = list(zip(gw, sw, strict=True))
            cell["gwtf_over_swarm_time"] = summary([g["makespan_s"] / s["makespan_s"] for g, s in pairs])
            cell["gwtf_over_swarm_throughput"] = summary(
                [g["throughput_mb_per_s"] / s["throughput_mb_per_s"] for g, s in pairs]
            )
            out[key] = cell
            print(f"  churn {key}: gwtf/swarm time {cell['gwtf_over_swarm_time']['median']:.3f}", file=sys.stderr)
    return out


def constants() -> dict:
    sc = load_scenario("gcp12")
    return {
        "source": "shoal/sim/scenarios/gcp12.json (copy of the SkipPipe authors' figures: " + sc.source + ")",
        "forward_s_per_layer_per_sample": sc.forward_s_per_layer_sample,
        "stage_forward_s_at_6_stages": sc.stage_forward_s(6),
        "backward_factor": sc.backward_factor,
        "loss_and_head_factor": sc.head_factor,
        "activation_bytes": sc.activation_bytes,
        "per_hop_overhead_s": sc.per_hop_overhead_s,
        "memory_microbatches_per_node": sc.memory,
        "gcp12_setting": {
            "nodes": sc.nodes,
            "nodes_per_stage": sc.nodes_per_stage,
            "microbatches": sc.microbatches,
            "skip": sc.skip,
            **AUTHORS_RULES,
        },
        "failure_timeout_s": RunSpec.failure_timeout_s,
        "join_warmup_s": RunSpec.join_warmup_s,
        "churn_levels_per_node_hour": CHURN_LEVELS,
        "churn_crash_share": 2 / 3,
        "churn_swarm": CHURN_SWARM,
        "heterogeneous": {
            "speed_range": SPEED_RANGE,
            "memory_range": MEMORY_RANGE,
            "access_GiBps_range": ACCESS_GIBPS_RANGE,
        },
        "all_reduce": "not modelled (identical for every policy at a setting; shoal gossips with NoLoCo instead)",
        "link_contention": "not modelled (each transfer gets its pair's full bandwidth)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed and small runs (smoke test)")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2, 3, 4]
    command = ".venv/bin/python benchmarks/scheduling.py" + (" --quick" if args.quick else "")
    started = time.perf_counter()
    print("gcp12 ...", file=sys.stderr)
    report = {
        "command": command,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "constants": constants(),
        "gcp12": gcp12(seeds, fixed_link=False),
        "gcp12_nl_london_fixed": gcp12(seeds, fixed_link=True),
    }
    print("scale ...", file=sys.stderr)
    report["scale"] = scale(SCALE_NODES[:2] if args.quick else SCALE_NODES)
    print("churn ...", file=sys.stderr)
    report["churn"] = churn(seeds, 60 if args.quick else CHURN_SWARM["microbatches"])
    report["benchmark_wall_s"] = time.perf_counter() - started
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    doc = write_section("scheduling", markdown(report))
    print(f"wrote {RESULTS.relative_to(ROOT)} and {doc.relative_to(ROOT)}", file=sys.stderr)
    return 0


def _ms(cell: dict, digits: int = 1) -> str:
    """Median (min–max) over seeds."""
    return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}–{cell['max']:.{digits}f})"


PAPER_GCP12 = {"dtfm": 142, "random-skip": 72, "skippipe-nocollision": 60, "skippipe": 53}


def _gcp12_table(g: dict) -> list[str]:
    lines = [
        "| policy | iteration time (s) | ÷ DT-FM | paper, real machines (s) | paper ÷ DT-FM |",
        "|---|---|---|---|---|",
    ]
    for name in ("dtfm", "random-skip", "skippipe-nocollision", "skippipe"):
        paper = PAPER_GCP12[name]
        lines.append(
            f"| {name} | {_ms(g['makespan_s'][name])} | {_ms(g['ratio_to_dtfm'][name], 3)} | ≈{paper} "
            f"| {paper / PAPER_GCP12['dtfm']:.2f} |"
        )
    return lines


def markdown(r: dict) -> str:
    c, g, gf = r["constants"], r["gcp12"], r["gcp12_nl_london_fixed"]
    seeds = g["makespan_s"]["dtfm"]["n"]
    out = [
        "# Scheduling benchmarks: SkipPipe vs DT-FM, GWTF vs SWARM",
        "",
        f"Reproduce with `{r['command']}` (from the repository root, in the venv); it took "
        f"{r['benchmark_wall_s']:.0f} s on this machine ({r['machine']['cpus']} CPUs, Python "
        f"{r['machine']['python']}) and writes `benchmarks/results/scheduling.json`. Every number below is "
        "virtual time from `shoal/sim` driving `shoal/planning`, except the planner wall times. Cells read "
        f"*median (min–max)* over {seeds} seeds; a seed changes the DT-FM allocation search, the random draws "
        "and the planner's perturbed re-plans (and, in the churn runs, the swarm and its churn).",
        "",
        "## SkipPipe vs DT-FM at the paper's setting (gcp12)",
        "",
        f"20 nodes round-robin over 12 GCP regions, 6 stages of 4 layers ({c['gcp12_setting']['nodes_per_stage']}"
        " nodes per stage, 5 data nodes), 30 microbatches per iteration (DT-FM: 3 pipelines x 10; SkipPipe: "
        "5 data nodes x 6), 33 % skip (3 of 5 block stages), at most 2 adjacent swaps, jumps of at most 4 "
        "stages, memory for 3 microbatches per node. All four policies use the same DT-FM allocation for a seed.",
        "",
        "Link table as given:",
        "",
        *_gcp12_table(g),
        "",
        "With the NL–London bandwidth corrected from 0.000237 to 0.2368 GiB/s (the scenario file's caveat):",
        "",
        *_gcp12_table(gf),
        "",
        "Reading the rows apart (as given / corrected):",
        "",
        f"- skipping alone, network-oblivious (random-skip ÷ DT-FM): {_ms(g['ratio_to_dtfm']['random-skip'], 3)}"
        f" / {_ms(gf['ratio_to_dtfm']['random-skip'], 3)};",
        "- network-aware paths without collision avoidance (skippipe-nocollision ÷ DT-FM): "
        f"{_ms(g['ratio_to_dtfm']['skippipe-nocollision'], 3)}"
        f" / {_ms(gf['ratio_to_dtfm']['skippipe-nocollision'], 3)};",
        "- collision avoidance, TC2 (skippipe ÷ skippipe-nocollision; paper: 53/60 = 0.88): "
        f"{_ms(g['collision_avoidance_gain'], 3)} / {_ms(gf['collision_avoidance_gain'], 3)}.",
        "",
        "Target: skippipe ÷ DT-FM ≤ 0.37 (the authors measured ≈0.37 on real machines, 53 s vs 142 s; their "
        f"simulator predicted 0.42). Measured here: **{g['ratio_to_dtfm']['skippipe']['median']:.3f}** (median; "
        f"{gf['ratio_to_dtfm']['skippipe']['median']:.3f} with the corrected link), so the target is **not met**. "
        "In this model both schedules are memory-bound (3 microbatches in flight per node): a DT-FM pipeline "
        "runs its 10 microbatches in 10/3 round trips of a full path, a SkipPipe data node its 6 in 2 round "
        "trips of a 3-of-5 path. Timing one microbatch alone per pipeline and per data node gives "
        f"2 x RT_skip / (10/3 x RT_full) = {_ms(g['unloaded_round_trip_estimate'], 3)} (as given) and "
        f"{_ms(gf['unloaded_round_trip_estimate'], 3)} (corrected) before any queueing. That is an estimate, "
        "not a bound, but it puts most of the gap to 0.37 in the unloaded round trips of this cost model "
        "rather than in the schedule; the rest is queueing the planner did not remove.",
        "",
        "Planner wall time at 20 nodes (2 shared cores): SkipPipe paths "
        f"{_ms(g['scheduler_wall_s']['skippipe_paths_only'], 3)} s, DT-FM allocation (phase A, shared with the "
        f"baseline) {_ms(g['scheduler_wall_s']['allocation_only'], 3)} s, together "
        f"{_ms(g['scheduler_wall_s']['skippipe_total'], 3)} s. The authors' CBS did not finish in minutes.",
        "",
        "## SkipPipe planner wall time as the swarm grows",
        "",
        f"Random heterogeneous swarms over the 12 regions, {SCALE_STAGES} stages, a quarter of the nodes data "
        "nodes, six microbatches per data node, collision-aware, one seed. The planner searches perturbed "
        "re-plans while a budget of 600 microbatch placements lasts, so large swarms get one plan.",
        "",
        "| nodes | data nodes | microbatches | plans searched | wall (s) | predicted makespan (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["scale"]:
        out.append(
            f"| {row['nodes']} | {row['data_nodes']} | {row['microbatches']} | {row['plans_searched']} "
            f"| {row['wall_s']:.2f} | {row['predicted_makespan_s']:.1f} |"
        )
    cs = c["churn_swarm"]
    out += [
        "",
        "## GWTF vs SWARM under churn",
        "",
        f"{cs['nodes']} nodes drawn over the 12 regions, {cs['stages']} stages, full pipelines, run until "
        f"{r['churn']['homogeneous/none']['swarm']['time_to_n_s']['n'] and cs['microbatches']} microbatches "
        "have completed. Churn: crash + leave events per node per hour (2/3 crashes), joins at the same rate; "
        f"low = {CHURN_LEVELS['low']} (CheckFree's highest rate, 33 %/h), high = {CHURN_LEVELS['high']} "
        "(ours: a mean stay of 30 min). A stage is never emptied. The SWARM baseline is its public "
        "balancer (no adaptive rebalancing, which its public code lacks), which restarts a microbatch "
        "that loses a hop in backward; GWTF redoes only the lost hop.",
        "",
        "| compute | churn | SWARM time to N (s) | GWTF time to N (s) | GWTF ÷ SWARM time | GWTF ÷ SWARM "
        "throughput | wasted compute s, SWARM / GWTF | abandoned, SWARM / GWTF | SWARM restarts | "
        "GWTF recomputed hops |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, cell in r["churn"].items():
        compute, level = key.split("/")
        sw, gw = cell["swarm"], cell["gwtf"]
        out.append(
            f"| {compute} | {level} ({cell['churn_per_node_hour']}/h) | {_ms(sw['time_to_n_s'], 0)} "
            f"| {_ms(gw['time_to_n_s'], 0)} | {_ms(cell['gwtf_over_swarm_time'], 3)} "
            f"| {_ms(cell['gwtf_over_swarm_throughput'], 3)} "
            f"| {sw['wasted_compute_s']['median']:.0f} / {gw['wasted_compute_s']['median']:.0f} "
            f"| {sw['abandoned']['median']:.0f} / {gw['abandoned']['median']:.0f} "
            f"| {sw['restarted']['median']:.0f} | {gw['recomputed_hops']['median']:.0f} |"
        )
    out += [
        "",
        "Paper (GWTF, heterogeneous nodes, 10 locations, high churn; its settings could not be recovered): up "
        "to 45 % less training time and up to 30 % more throughput than SWARM (a time ratio down to 0.55, a "
        "throughput ratio up to 1.30). Our GWTF is an interpretation (the paper publishes no code): min-max "
        "routes within capacity, refined by annealing; data nodes spread microbatches over their routes by "
        "expected finish; a sender swaps a full planned next hop for the cheapest replica with room; a lost "
        "hop is redone alone. Without churn its lead over SWARM comes from those routing choices; with churn, "
        "also from SWARM's restarts.",
        "",
        "## Constants and assumptions",
        "",
        f"- Compute: forward {c['forward_s_per_layer_per_sample']} s per layer per sample (8 samples, 4 layers a "
        f"stage: {c['stage_forward_s_at_6_stages']:.2f} s a stage), backward {c['backward_factor']}x, loss and "
        f"LM head {c['loss_and_head_factor']}x on the data node; stage 0 also holds 4 layers, as in the authors' "
        "code. Nodes compute one task at a time; without a plan, backward before forward, else first come first "
        "served.",
        f"- Links: one-way latency + {c['activation_bytes']} B / bandwidth + {c['per_hop_overhead_s']} s per hop, "
        "per region pair from gcp12 (same region: 1 ms, 2 GiB/s); gradients are as large as activations. "
        f"Link contention is {c['link_contention']}.",
        f"- Memory: {c['memory_microbatches_per_node']} microbatches per node (random heterogeneous swarms: "
        f"{c['heterogeneous']['memory_range']}), held from admission until that microbatch's backward there.",
        f"- Heterogeneous swarms: speed log-uniform in {c['heterogeneous']['speed_range']}x, own access bandwidth "
        f"log-uniform in {c['heterogeneous']['access_GiBps_range']} GiB/s.",
        f"- Churn: a silent crash is noticed after {c['failure_timeout_s']} s (a send or an expected reply times "
        f"out; planners' views drop the node then); a joining node serves after {c['join_warmup_s']} s of weight "
        "copying and is placed by its policy (GWTF: most added throughput; SWARM: least-served stage); joiners "
        "are never data nodes; a microbatch whose data node crashes is abandoned with that reason.",
        f"- All-reduce: {c['all_reduce']}.",
        "- DT-FM allocation: simulated annealing with restarts over DP_cost + 2 * PP_cost (link weight = one "
        "activation's transfer time; the hop back to the data node counted in PP_cost), where the authors ran "
        "a genetic algorithm.",
        "- SkipPipe scheduling: prioritised planning with a beam of 4 per hop and a bounded perturbed re-plan "
        "search, where the authors ran Conflict-Based Search.",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
