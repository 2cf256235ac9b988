"""`shoal sim`: simulate one policy's scheduling of a swarm in virtual time and print what it cost.

    shoal sim --scenario gcp12 --policy skippipe                 # the SkipPipe paper's setting
    shoal sim --scenario gcp12 --policy dtfm --json              # the full-pipeline baseline
    shoal sim --scenario random --nodes 40 --stages 6 --policy gwtf --churn 2 --microbatches 300

Static policies (dtfm, random-skip, skippipe) plan one iteration of --microbatches and report its
makespan; continuous ones (swarm, gwtf) run until --microbatches have completed.
"""

from __future__ import annotations

import argparse
import json

from shoal.planning.policy import POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario", default="gcp12", help="gcp12, random (generated over gcp12's regions), or a .json file"
    )
    parser.add_argument("--policy", default="skippipe", choices=POLICIES)
    parser.add_argument("--nodes", type=int, default=None, help="default: the scenario's (gcp12: 20)")
    parser.add_argument("--stages", type=int, default=None, help="default: the scenario's (gcp12: 6)")
    parser.add_argument("--skip", type=float, default=None, help="share of block stages a path skips (gcp12: 0.33)")
    parser.add_argument(
        "--churn", type=float, default=0.0, help="crash + leave events per node per hour (block-stage nodes only)"
    )
    parser.add_argument("--churn-data-nodes", action="store_true", help="churn takes data nodes too")
    parser.add_argument(
        "--heartbeat", type=float, default=10.0, help="seconds between load adverts and view reads (0: omniscient)"
    )
    parser.add_argument(
        "--replan", type=float, default=1.0, help="seconds a re-plan takes once a heartbeat saw a change"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--microbatches", type=int, default=None, help="default: the scenario's per iteration (30)")
    parser.add_argument(
        "--no-collision-avoidance",
        action="store_true",
        help="skippipe: choose paths on network cost alone and let nodes queue (SkipPipe without TC2)",
    )
    parser.add_argument("--max-swaps", type=int, default=None, help="adjacent stage swaps per path (gcp12: 2)")
    parser.add_argument("--max-jump", type=int, default=None, help="stages a path may jump ahead (authors: 4)")
    parser.add_argument(
        "--allocation",
        choices=("dtfm", "given"),
        default="dtfm",
        help="static policies: re-allocate stages by DT-FM's objective first, or keep the scenario's",
    )
    parser.add_argument("--homogeneous", action="store_true", help="random scenario: identical compute and memory")
    parser.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma on every compute time")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from shoal.errors import UsageError
    from shoal.sim.metrics import format_table
    from shoal.sim.run import RunSpec, simulate

    if args.nodes is not None and args.nodes < 2:
        raise UsageError("--nodes must be at least 2")
    if args.jitter < 0:
        raise UsageError("--jitter must be >= 0")
    spec = RunSpec(
        scenario=args.scenario,
        policy=args.policy,
        nodes=args.nodes,
        stages=args.stages,
        skip=args.skip,
        churn=args.churn,
        churn_data_nodes=args.churn_data_nodes,
        heartbeat_s=args.heartbeat,
        replan_s=args.replan,
        seed=args.seed,
        microbatches=args.microbatches,
        collision_aware=not args.no_collision_avoidance,
        max_swaps=args.max_swaps,
        max_jump=args.max_jump,
        allocation=args.allocation,
        heterogeneous=not args.homogeneous,
        jitter=args.jitter,
    )
    result = simulate(spec)
    print(json.dumps(result.to_dict(), indent=2, sort_keys=True) if args.json else format_table(result))
    return 0
