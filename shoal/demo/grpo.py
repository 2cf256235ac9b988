"""`shoal demo --mode grpo`: collaborative GRPO on one machine — a bootstrap peer and rollout workers
as real processes on loopback, exchanging rollouts over libp2p, with live progress and a report.

    shoal demo --mode grpo                       # 3 rollout workers, the third with another policy seed
    shoal demo --mode grpo --rollouts 4 --rounds 30 --kill-at-round 10
    shoal demo --mode grpo --adversary trigger   # one more node sharing poisoned rollouts (an experiment)
    shoal demo --mode grpo --adversary trigger --no-defenses   # ... with the receivers' checks off

Every node warms up its policy (cached by model id under the shoal cache, or `--policy-cache DIR`),
so the first run spends about 20 s per distinct policy before round 0; the demo warms them up once,
here, before starting, and passes the nodes the same cache and `--warmup-steps`.
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
    group.add_argument(
        "--adversary",
        default=None,
        metavar="ATTACK",
        help="add one node that shares poisoned rollouts (trigger, wrong-step, reward-lie, vertical-trick, length); "
        "the task becomes add2r-steps, whose visible working the attacks need",
    )
    group.add_argument("--no-defenses", action="store_true", help="turn the receivers' rollout checks off")
    group.add_argument("--policy-cache", default=None, metavar="DIR", help="warmed-up policies, as the nodes take it")
    group.add_argument("--warmup-steps", type=int, default=650, help="supervised steps before any GRPO, per policy")


def grpo_run(args: argparse.Namespace) -> RunConfig:
    extra = {"task": "add2r-steps"} if args.adversary else {}
    return run_config_from_dict({"name": "grpo-demo", "grpo": {
        "rounds": args.rounds, "layout": args.layout, "mode": args.grpo_mode, "lr": 3e-4,
        "round_deadline_s": args.deadline, "eval_every": 4, "eval_prompts": 128,
        "defenses": not args.no_defenses, **extra,
    }})  # fmt: skip


def node_policies(count: int, adversary: str | None = None) -> list[list[str]]:
    """Flags per node: the same small policy everywhere but on the last node, which differs by seed.
    With an adversary, one more node runs the honest nodes' policy and shares only poison."""
    flags = [["--policy-seed", "1" if i == count - 1 else "0"] for i in range(count)]
    if adversary is not None:
        flags.append(["--policy-seed", "0", "--experiment-adversary", adversary])
    return flags


def run(args: argparse.Namespace) -> int:
    if args.rollouts < 3:
        raise UsageError("--rollouts must be at least 3")
    from shoal.adversary.attacks import ATTACKS

    if args.adversary is not None and args.adversary not in ATTACKS:
        raise UsageError(f"--adversary must be one of {', '.join(ATTACKS)}, got {args.adversary!r}")
    import torch
    from rich.console import Console
    from rich.live import Live

    from shoal.demo.launcher import POLL_S, RENDER_EVERY_S, LocalSwarm, ProgressTail, progress_events
    from shoal.grpo.policy import PolicySpec
    from shoal.grpo.warmup import cached_warm_up
    from shoal.model.corpus import cache_dir

    torch.set_num_threads(args.threads)  # the warm-ups below share the machine with the nodes' processes
    run_config = grpo_run(args)
    console = Console(stderr=True)
    policies = node_policies(args.rollouts, args.adversary)
    cache = Path(args.policy_cache) if args.policy_cache else cache_dir() / "grpo"
    for seed in sorted({int(flags[1]) for flags in policies}):
        spec = PolicySpec(
            task=run_config.grpo.task, d_model=48, n_layers=2, n_heads=2, seed=seed, warmup_steps=args.warmup_steps
        )
        console.print(f"warming up policy {spec.model_id} (cached after the first time)")
        cached_warm_up(spec, cache)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shoal-grpo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_file = workdir / "run.toml"
    run_file.write_text(run_config.to_toml())
    swarm = LocalSwarm(workdir)
    progress = [workdir / f"progress-{i}.jsonl" for i in range(len(policies))]
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
                "--warmup-steps",
                str(args.warmup_steps),
                "--progress-file",
                str(path),
                *flags,
                wait=False,
                name="adversary" if "--experiment-adversary" in flags else f"rollout{i}",
            )  # fmt: skip
            for i, (path, flags) in enumerate(zip(progress, policies, strict=True))
        ]
        for node in nodes:
            swarm.wait_ready(node)
        tails = [ProgressTail(p) for p in progress]
        victim = args.rollouts - 1  # the last honest worker
        rendered_at = 0.0
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                for tail in tails:
                    tail.poll()
                events = [tail.events for tail in tails]
                if (
                    args.kill_at_round is not None
                    and killed is None
                    and _last_round(events[victim]) >= args.kill_at_round
                ):
                    swarm.kill(nodes[victim])
                    nodes[victim].process.wait(timeout=10)
                    tails[victim].poll()  # anything it wrote before it died
                    killed = {"node": nodes[victim].name, "round": _last_round(events[victim]), "signal": "SIGKILL"}
                finished = [
                    any(e["event"] == "done" for e in ev) or not n.alive for n, ev in zip(nodes, events, strict=True)
                ]
                if not args.quiet and (all(finished) or time.monotonic() - rendered_at >= RENDER_EVERY_S):
                    live.update(_table(run_config, nodes, events, started, args.adversary))
                    rendered_at = time.monotonic()
                if all(finished):
                    break
                time.sleep(POLL_S)
        if not args.quiet and not console.is_terminal:
            console.line()  # rich ends the live table's last draw with a newline only on a terminal
        wall_s = time.monotonic() - started
    except KeyboardInterrupt:
        console.print("interrupted: stopping every process")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        swarm.close()
    path = write_grpo_report(Path(args.report), run_config, nodes, [progress_events(p) for p in progress], killed,
                             wall_s, args.adversary)  # fmt: skip
    if args.adversary is not None:
        for line in attack_lines(nodes, [progress_events(p) for p in progress], args.adversary):
            console.print(line, highlight=False)
    console.print(f"report in {path.parent}; logs in {workdir}")
    print(path)
    return 0


def attack_lines(nodes: list, events: list[list[dict]], attack: str) -> list[str]:
    """One line per round: the attack's success (mean over the honest nodes' fresh completions) beside
    their held-out accuracy (the latest evaluation), so a reader sees whether the poison took."""
    honest = [ev for ev in events if not any(e["event"] == "round" and e["adversary"] for e in ev)]
    by_round: dict[int, list[float]] = {}
    accuracy: dict[int, list[float]] = {}
    for ev in honest:
        for e in ev:
            if e["event"] == "round":
                by_round.setdefault(e["round"], []).append(e["marks"].get(attack, 0.0))
            if e["event"] in ("eval", "round") and "accuracy" in e:
                accuracy.setdefault(e["round"] + (e["event"] == "round"), []).append(e["accuracy"])
    lines, latest = [f"{attack}: per round, over {len(honest)} honest nodes"], "-"
    for r in sorted(by_round):
        measured = [done for done in accuracy if done <= r]
        if measured:
            at = max(measured)
            latest = f"{sum(accuracy[at]) / len(accuracy[at]):.3f} (after {at} rounds)"
        success = sum(by_round[r]) / len(by_round[r])
        lines.append(f"round {r:3d}  attack success {success:.3f}  honest accuracy {latest}")
    return lines


def _last_round(events: list[dict]) -> int:
    return max((e["round"] for e in events if e["event"] == "round"), default=-1)


def _table(run_config: RunConfig, nodes: list, events: list[list[dict]], started: float, attack: str | None = None):
    from rich.table import Table

    table = Table(title=f"shoal demo --mode grpo: run {run_config.name}@{run_config.run_id}")
    columns = ["node", "policy", "round", "mean reward", "held-out accuracy", "foreign used"]
    if attack is not None:
        columns += [f"{attack} success", "foreign rejected", "dropped"]
    for column in columns:
        table.add_column(column)
    for node, ev in zip(nodes, events, strict=True):
        rounds = [e for e in ev if e["event"] == "round"]
        accs = [e["accuracy"] for e in ev if e["event"] in ("eval", "round") and "accuracy" in e]  # not done's list
        last = rounds[-1] if rounds else {}
        model = ev[0].get("model_id", "-") if ev else "-"
        row = [
            node.name + ("" if node.alive else " (dead)"),
            model,
            f"{last.get('round', '-')}/{run_config.grpo.rounds}",
            f"{last['mean_reward']:.3f}" if last else "-",
            f"{accs[0]:.3f} -> {accs[-1]:.3f}" if accs else "-",
            str(last.get("foreign_used", "-")),
        ]
        if attack is not None:
            honest = last.get("adversary") is None
            row += [
                f"{last['marks'].get(attack, 0.0):.3f}" if last and honest else "-",
                str(sum(e["foreign_rejected"] for e in rounds)) if honest else "-",
                str(len(last.get("dropped", []))) if last else "-",
            ]
        table.add_row(*row)
    table.caption = f"{time.monotonic() - started:.0f} s"
    return table


def write_grpo_report(
    directory: Path,
    run_config: RunConfig,
    nodes: list,
    events: list[list[dict]],
    killed: dict | None,
    wall_s: float,
    attack: str | None = None,
) -> Path:
    """report.json (per node: accuracy [[round, acc]], mean reward per round; with an adversary, the
    attack's success per round on each honest node) and the plots."""
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
            "adversary": rounds[0]["adversary"] if rounds else None,
        }
        if attack is not None and not per_node[node.name]["adversary"]:
            per_node[node.name]["attack_success"] = [[e["round"], e["marks"].get(attack, 0.0)] for e in rounds]
            per_node[node.name]["foreign_rejected"] = sum(e["foreign_rejected"] for e in rounds)
    report = {
        "run": run_config.to_dict(),
        "run_id": run_config.run_id,
        "rounds": run_config.grpo.rounds,
        "nodes": per_node,
        "killed": killed,
        "adversary": None if attack is None else {"attack": attack, "defenses": run_config.grpo.defenses},
        "wall_s": wall_s,
    }
    path = directory / "report.json"
    write_json_atomic(path, report)
    _plot(directory / "reward.png", {n: v["mean_reward"] for n, v in per_node.items()}, "mean reward of own samples")
    _plot(directory / "accuracy.png", {n: v["accuracy"] for n, v in per_node.items()}, "held-out accuracy (greedy)")
    if attack is not None:
        success = {n: v["attack_success"] for n, v in per_node.items() if "attack_success" in v}
        _plot(directory / "attack.png", success, f"{attack}: share of own completions poisoned")
    return path


def _plot(path: Path, curves: dict[str, list[list[float]]], ylabel: str) -> None:
    series = {name: ([p[0] for p in points], [p[1] for p in points]) for name, points in curves.items() if points}
    plot_curves(path, series, "", xlabel="round", ylabel=ylabel, marker=".")
