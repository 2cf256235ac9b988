"""`shoal demo --mode grpo`: collaborative GRPO on one machine — a bootstrap peer and rollout workers
as real processes on loopback, exchanging rollouts over libp2p, with live progress and a report.

    shoal demo --mode grpo                       # 3 rollout workers, the third with another policy seed
    shoal demo --mode grpo --rollouts 4 --rounds 30 --kill-at-round 10

Every node warms up its policy (cached by model id under the shoal cache), so the first run spends
about 20 s per distinct policy before round 0; the demo warms them up once, here, before starting.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path

from shoal.config import RunConfig, run_config_from_dict
from shoal.errors import UsageError
from shoal.report import plot_curves, write_json_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--mode grpo")
    group.add_argument("--rollouts", type=int, default=3, help="rollout workers (at least 3)")
    group.add_argument("--rounds", type=int, default=24, help="GRPO rounds per worker")
    group.add_argument("--layout", choices=("horizontal", "vertical"), default="horizontal")
    group.add_argument("--grpo-mode", choices=("alone", "naive", "tis", "ftis"), default="ftis")
    group.add_argument("--deadline", type=float, default=4.0, help="seconds a round waits for peers' bundles")
    group.add_argument("--kill-at-round", type=int, default=None, help="SIGKILL the last worker at this round")


def grpo_run(args: argparse.Namespace) -> RunConfig:
    return run_config_from_dict({"name": "grpo-demo", "grpo": {
        "rounds": args.rounds, "layout": args.layout, "mode": args.grpo_mode, "lr": 3e-4,
        "round_deadline_s": args.deadline, "eval_every": 4, "eval_prompts": 128,
    }})  # fmt: skip


def node_policies(count: int) -> list[list[str]]:
    """Flags per node: the same small policy everywhere but on the last node, which differs by seed."""
    return [["--policy-seed", "1" if i == count - 1 else "0"] for i in range(count)]


def run(args: argparse.Namespace) -> int:
    if args.rollouts < 3:
        raise UsageError("--rollouts must be at least 3")
    import torch
    from rich.console import Console
    from rich.live import Live

    from shoal.demo.launcher import LocalSwarm, progress_events
    from shoal.grpo.policy import PolicySpec
    from shoal.grpo.warmup import cached_warm_up
    from shoal.model.corpus import cache_dir

    torch.set_num_threads(args.threads)  # the warm-ups below share the machine with the nodes' processes
    run_config = grpo_run(args)
    console = Console(stderr=True)
    policies = node_policies(args.rollouts)
    cache = cache_dir() / "grpo"
    for seed in sorted({int(flags[1]) for flags in policies}):
        spec = PolicySpec(task=run_config.grpo.task, d_model=48, n_layers=2, n_heads=2, seed=seed, warmup_steps=650)
        console.print(f"warming up policy {spec.model_id} (cached after the first time)")
        cached_warm_up(spec, cache)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shoal-grpo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_file = workdir / "run.toml"
    run_file.write_text(run_config.to_toml())
    swarm = LocalSwarm(workdir)
    progress = [workdir / f"progress-{i}.jsonl" for i in range(args.rollouts)]
    started, killed = time.monotonic(), None
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        nodes = [
            swarm.start_node(
                [entry],
                "--role",
                "rollout",
                "--threads",
                str(args.threads),
                "--record-ttl",
                str(args.record_ttl),
                "--policy-cache",
                str(cache),
                "--progress-file",
                str(path),
                *flags,
                wait=False,
                name=f"rollout{i}",
            )  # fmt: skip
            for i, (path, flags) in enumerate(zip(progress, policies, strict=True))
        ]
        for node in nodes:
            swarm.wait_ready(node)
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                events = [progress_events(p) for p in progress]
                if args.kill_at_round is not None and killed is None and _last_round(events[-1]) >= args.kill_at_round:
                    swarm.kill(nodes[-1])
                    killed = {"node": nodes[-1].name, "round": args.kill_at_round, "signal": "SIGKILL"}
                if not args.quiet:
                    live.update(_table(run_config, nodes, events, started))
                finished = [
                    any(e["event"] == "done" for e in ev) or not n.alive for n, ev in zip(nodes, events, strict=True)
                ]
                if all(finished):
                    break
                time.sleep(0.5)
        wall_s = time.monotonic() - started
    except KeyboardInterrupt:
        console.print("interrupted: stopping every process")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        swarm.close()
    path = write_grpo_report(Path(args.report), run_config, nodes, [progress_events(p) for p in progress], killed,
                             wall_s)  # fmt: skip
    console.print(f"report in {path.parent}; logs in {workdir}")
    print(path)
    return 0


def _last_round(events: list[dict]) -> int:
    return max((e["round"] for e in events if e["event"] == "round"), default=-1)


def _table(run_config: RunConfig, nodes: list, events: list[list[dict]], started: float):
    from rich.table import Table

    table = Table(title=f"shoal demo --mode grpo: run {run_config.name}@{run_config.run_id}")
    for column in ("node", "policy", "round", "mean reward", "held-out accuracy", "foreign used"):
        table.add_column(column)
    for node, ev in zip(nodes, events, strict=True):
        rounds = [e for e in ev if e["event"] == "round"]
        accs = [e["accuracy"] for e in ev if "accuracy" in e]
        last = rounds[-1] if rounds else {}
        model = ev[0].get("model_id", "-") if ev else "-"
        table.add_row(
            node.name + ("" if node.alive else " (dead)"),
            model,
            f"{last.get('round', '-')}/{run_config.grpo.rounds}",
            f"{last['mean_reward']:.3f}" if last else "-",
            f"{accs[0]:.3f} -> {accs[-1]:.3f}" if accs else "-",
            str(last.get("foreign_used", "-")),
        )
    table.caption = f"{time.monotonic() - started:.0f} s"
    return table


def write_grpo_report(
    directory: Path, run_config: RunConfig, nodes: list, events: list[list[dict]], killed: dict | None, wall_s: float
) -> Path:
    """report.json (per node: accuracy [[round, acc]], mean reward per round) and two plots."""
    directory.mkdir(parents=True, exist_ok=True)
    per_node = {}
    for node, ev in zip(nodes, events, strict=True):
        rounds = [e for e in ev if e["event"] == "round"]
        evaluations = [e for e in ev if e["event"] in ("eval", "round") and "accuracy" in e]
        per_node[node.name] = {
            "peer_id": node.peer_id,
            "model_id": ev[0].get("model_id") if ev else None,
            "accuracy": [[e["round"] + (e["event"] == "round"), e["accuracy"]] for e in evaluations],
            "mean_reward": [[e["round"], e["mean_reward"]] for e in rounds],
            "foreign_used": sum(e["foreign_used"] for e in rounds),
            "foreign_dropped": sum(e["foreign_dropped"] for e in rounds),
            "refused": sum(len(e["refused"]) for e in rounds),
        }
    report = {
        "run": run_config.to_dict(),
        "run_id": run_config.run_id,
        "rounds": run_config.grpo.rounds,
        "nodes": per_node,
        "killed": killed,
        "wall_s": wall_s,
    }
    path = directory / "report.json"
    write_json_atomic(path, report)
    _plot(directory / "reward.png", {n: v["mean_reward"] for n, v in per_node.items()}, "mean reward of own samples")
    _plot(directory / "accuracy.png", {n: v["accuracy"] for n, v in per_node.items()}, "held-out accuracy (greedy)")
    return path


def _plot(path: Path, curves: dict[str, list[list[float]]], ylabel: str) -> None:
    series = {name: ([p[0] for p in points], [p[1] for p in points]) for name, points in curves.items() if points}
    plot_curves(path, series, "", xlabel="round", ylabel=ylabel, marker=".")
