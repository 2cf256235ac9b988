"""`shoal demo`: the whole thing on one machine — a bootstrap peer, a data node and stage workers as
real processes on loopback, training the bundled model with live progress and a report.

    shoal demo                          # 1 data node + 2 workers per block stage, the `tiny` run
    shoal demo --crash-at-step 60       # SIGKILL one worker mid-run: the swarm routes around it
    shoal demo --averaging diloco       # all-reduce baseline (hivemind's DecentralizedAverager); none: no sharing
    shoal demo --kill-stage 2 --at-step 90 --repair checkfree_plus
                                        # SIGKILL every replica of stage 2, start a new node: it rebuilds the stage
    shoal demo --mode grpo              # collaborative GRPO between rollout workers (shoal/demo/grpo.py)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from shoal.config import REPAIR_RULES
from shoal.device import DEVICE_HELP
from shoal.errors import UsageError
from shoal.train.command import add_run_arguments, resolve_run_source


def averaging_overrides(mode: str) -> dict:
    """Run-config overrides for an averaging mode, with the authors' outer momentum for DiLoCo (0.3) and
    int8 exchanges there (an all-reduce sums dense tensors: the bundled runs' top-k is NoLoCo's only)."""
    return {"averaging.mode": mode, **({"averaging.alpha": 0.3, "averaging.codec": "int8"} if mode == "diloco" else {})}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shoal.demo import grpo

    add_run_arguments(parser)
    parser.add_argument("--mode", choices=("pipeline", "grpo"), default="pipeline", help="what the swarm trains")
    grpo.add_arguments(parser)
    parser.add_argument(
        "--workers-per-stage", type=int, default=2, help="stage workers per block stage (placed there with --stage)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node process")
    parser.add_argument(
        "--device",
        default="auto",
        help=f"{DEVICE_HELP} (every node computes there: they share it)",
    )
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL one stage worker (of a stage with a spare replica) at this step",
    )
    parser.add_argument(
        "--kill-stage",
        type=int,
        default=None,
        metavar="S",
        help="SIGKILL every replica of block stage S (with --at-step) and start a node that rebuilds it",
    )
    parser.add_argument("--at-step", type=int, default=None, metavar="K", help="the step of --kill-stage")
    parser.add_argument(
        "--restart-after",
        type=float,
        default=3.0,
        metavar="S",
        help="start a killed worker again, same flags, S seconds later, as a volunteer's restart would (0: never)",
    )
    parser.add_argument(
        "--repair",
        choices=REPAIR_RULES,
        default=None,
        help="how a lost stage is rebuilt (default: from a neighbour's backup, else the run's rule, checkfree); "
        "naming a rule turns the backups (and an imported run's restore from its checkpoint) off, so that the rule is "
        "what runs; checkfree_plus also swaps edge stages",
    )
    parser.add_argument(
        "--averaging",
        choices=("noloco", "diloco", "none"),
        default=None,
        help="how replicas of a stage share weights (default: the run's, NoLoCo for the bundled run)",
    )
    parser.add_argument("--record-ttl", type=float, default=6.0, help="node record lifetime (s)")
    parser.add_argument("--report", default="demo-report", metavar="DIR", help="write report.json and loss.png here")
    parser.add_argument("--workdir", default=None, help="keep node logs here (default: a temporary folder)")
    parser.add_argument("--quiet", action="store_true", help="no live progress")


def _render(run, events: list[dict], alive: int, total: int, started: float, note: str):
    from rich.table import Table

    steps = [e for e in events if e["event"] == "step"]
    last = steps[-1] if steps else {}
    table = Table(title=f"shoal demo: run {run.name}@{run.run_id}", show_header=False, min_width=60)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("step", f"{len(steps)}/{run.train.steps}")
    table.add_row("loss", f"{last['loss']:.3f}" if last.get("loss") is not None else "-")
    table.add_row("tokens/s", f"{last.get('tokens_per_s', 0):,.0f}")
    table.add_row(
        "microbatches",
        f"{last.get('microbatches_completed', 0)} done, "
        f"{last.get('microbatches_abandoned', 0)} abandoned, {last.get('in_flight', 0)} in flight",
    )
    table.add_row("nodes alive", f"{alive}/{total}")
    table.add_row("elapsed", f"{time.monotonic() - started:.0f} s")
    if note:
        table.add_row("event", note)
    return table


def run(args: argparse.Namespace) -> int:
    if args.mode == "grpo":
        from shoal.demo.grpo import run as run_grpo

        return run_grpo(args)
    source = resolve_run_source(args)
    run_config = source.config
    if args.workers_per_stage < 1:
        raise UsageError("--workers-per-stage must be at least 1")
    if (args.kill_stage is None) != (args.at_step is None):
        raise UsageError("--kill-stage and --at-step go together")
    if args.kill_stage is not None and not 1 <= args.kill_stage < run_config.pipeline.stages:
        raise UsageError(f"--kill-stage must be a block stage, 1..{run_config.pipeline.stages - 1}")
    from rich.console import Console
    from rich.live import Live

    from shoal.demo.launcher import POLL_S, RENDER_EVERY_S, LocalSwarm, ProgressTail
    from shoal.demo.report import build_report
    from shoal.model.checkpoint import verify
    from shoal.model.corpus import default_corpus_path
    from shoal.train.data import load_token_splits, with_local_data

    if args.averaging is not None:
        run_config = run_config.replace(averaging_overrides(args.averaging))
    if args.repair is not None:
        rule_only = {"repair.rule": args.repair, "repair.backup_every": 0, "repair.from_checkpoint": False}
        run_config = run_config.replace(rule_only)
    if not run_config.data.path:  # resolve the corpus once, here, so every node reads the same file
        run_config = with_local_data(run_config, default_corpus_path())
    console = Console(stderr=True)
    # an imported run: every node is handed the checkpoint, as a volunteer would have it on disk, and the
    # data is read with its tokenizer
    checkpoint = verify(source.checkpoint_dir, run_config.model) if source.checkpoint_dir is not None else None
    console.print(f"preparing data: {run_config.data.path}")
    tokenizer_file = checkpoint.tokenizer_file if checkpoint is not None else None
    load_token_splits(run_config.data, run_config.model.vocab_size, tokenizer_file)  # trains + caches it once

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shoal-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_file = workdir / "run.toml"
    run_file.write_text(run_config.to_toml())
    progress = workdir / "progress.jsonl"
    swarm = LocalSwarm(workdir)
    node_args = ["--threads", str(args.threads), "--record-ttl", str(args.record_ttl), "--microbatch-timeout", "30",
                 "--device", args.device]  # fmt: skip
    if checkpoint is not None:
        node_args += ["--checkpoint", str(checkpoint.path.resolve())]
    crash: dict = {}
    wipe: dict = {}
    restarts = Restarts(swarm, entry="", node_args=node_args, workdir=workdir, after_s=args.restart_after)
    started = time.monotonic()
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        restarts.entry = entry
        console.print(f"bootstrap peer: {entry}", soft_wrap=True)
        # The demo places its workers (`--stage`) so the layout is the one asked for: left to choose at
        # once, 4 workers once split 3/1 and kept it (a trained node no longer moves).
        block_stages = run_config.pipeline.stages - 1
        workers = [
            swarm.start_node(
                [entry],
                "--role",
                "worker",
                "--stage",
                str(1 + i % block_stages),
                "--stats-file",
                str(workdir / f"stats-w{i}.json"),
                *node_args,
                wait=False,
                name=f"worker{i}",
            )
            for i in range(args.workers_per_stage * block_stages)
        ]
        for worker in workers:
            swarm.wait_ready(worker)
        data = swarm.start_node(
            [entry],
            "--role",
            "data",
            "--progress-file",
            str(progress),
            "--stats-file",
            str(workdir / "stats-data.json"),
            *node_args,
            name="data",
        )
        console.print(f"{len(workers)} stage workers and 1 data node active after {time.monotonic() - started:.0f} s")
        note = ""
        tail = ProgressTail(progress)
        steps, done, rendered_at = 0, None, 0.0
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while True:
                for event in tail.poll():
                    steps += event["event"] == "step"
                    if event["event"] == "repair":
                        rebuilt = f"stage {event['stage']} rebuilt by {event['rule']} from {event['sources']}"
                        note = f"step {event['step']}: {rebuilt}"
                    elif event["event"] == "done":
                        done = event
                if args.crash_at_step is not None and not crash and steps >= args.crash_at_step:
                    crash = _crash_one_worker(swarm, workers, entry, steps)
                    note = f"step {steps}: SIGKILL worker {crash.get('peer_id', '?')[-8:]} (stage {crash.get('stage')})"
                    if "stage" in crash:
                        restarts.schedule(crash["stage"], steps)
                if args.kill_stage is not None and not wipe and steps >= args.at_step:
                    wipe = _wipe_stage(swarm, workers, entry, args.kill_stage, steps, node_args, workdir)
                    note = (
                        f"step {steps}: SIGKILL all {len(wipe.get('peer_ids', []))} replicas of stage {args.kill_stage}"
                    )
                    if wipe.get("replacement"):  # the first one's place went to the rebuilding node
                        restarts.joining[args.kill_stage] = workers[-1]  # the others copy from it once it is active
                    for _ in wipe.get("peer_ids", [])[1:]:
                        restarts.schedule(args.kill_stage, steps)
                restarted = restarts.due(workers, steps)
                if restarted:
                    note = f"step {steps}: restarted a worker for stage {restarted}"
                if not args.quiet and (done or time.monotonic() - rendered_at >= RENDER_EVERY_S):
                    alive = sum(p.alive for p in swarm.peers)
                    live.update(_render(run_config, tail.events, alive, len(swarm.peers), started, note))
                    rendered_at = time.monotonic()
                if done:
                    break
                if not data.alive:
                    raise UsageError(f"the data node exited ({data.process.returncode}); see {data.log_path}")
                time.sleep(POLL_S)
        if not args.quiet and not console.is_terminal:
            console.line()  # rich ends the live table's last draw with a newline only on a terminal
        wall_s = time.monotonic() - started
        replicas = live_replicas(workers)
    except KeyboardInterrupt:
        console.print("interrupted: stopping every process")
        swarm.close()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        swarm.close()
    tail.poll()  # anything written after the loop saw "done"
    report_path = build_report(Path(args.report), run_config, tail.events, swarm, workdir, crash, wall_s, wipe,
                               restarts=restarts.done, replicas_at_end=replicas)  # fmt: skip
    summary = json.loads(report_path.read_text())
    console.print(
        f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f}, val {summary['val_loss']:.3f}; "
        f"microbatches {summary['microbatches_injected']} injected = {summary['microbatches_completed']} "
        f"completed + {summary['microbatches_abandoned']} abandoned; {wall_s:.0f} s; logs in {workdir}"
    )
    print(report_path)
    return 0


class Restarts:
    """Killed workers started again `after_s` later with the same flags, as a volunteer's service
    manager would, so that the demo's stages do not quietly lose a replica for the rest of the run.
    Two restarts for one stage go one at a time: the second copies from the first."""

    def __init__(self, swarm, entry: str, node_args: list[str], workdir: Path, after_s: float):
        self.swarm, self.entry, self.node_args, self.workdir, self.after_s = swarm, entry, node_args, workdir, after_s
        self.pending: list[tuple[float, int, int]] = []  # (due, stage, step killed)
        self.joining: dict[int, object] = {}  # stage -> the restarted node not yet active
        self.done: list[dict] = []

    def schedule(self, stage: int, step: int) -> None:
        if self.after_s > 0:
            self.pending.append((time.monotonic() + self.after_s, stage, step))

    def due(self, workers: list, step: int) -> int | None:
        """Start the first restart that is due, if its stage has none still joining; its stage."""
        for stage, peer in list(self.joining.items()):
            if peer.ready_file.exists() or not peer.alive:
                del self.joining[stage]
        for item in sorted(self.pending):
            when, stage, killed_at = item
            if when > time.monotonic() or stage in self.joining:
                continue
            self.pending.remove(item)
            index = len(workers)
            peer = self.swarm.start_node(
                [self.entry], "--role", "worker", "--stage", str(stage), "--stats-file",
                str(self.workdir / f"stats-w{index}.json"), *self.node_args, wait=False, name=f"worker{index}",
            )  # fmt: skip
            workers.append(peer)
            self.joining[stage] = peer
            self.done.append({"stage": stage, "killed_at_step": killed_at, "restarted_at_step": step,
                              "node": peer.name})  # fmt: skip
            return stage
        return None


def live_replicas(workers: list) -> dict[str, int]:
    """Live, active workers per block stage, as the launcher sees them (from their ready files)."""
    counts: dict[str, int] = {}
    for worker in workers:
        if worker.alive and worker.ready_file is not None and worker.ready_file.exists():
            stage = str(worker.current_stage())
            counts[stage] = counts.get(stage, 0) + 1
    return dict(sorted(counts.items()))


def _crash_one_worker(swarm, workers: list, entry: str, step: int) -> dict:
    """SIGKILL one replica of the first block stage that has a spare (the launcher knows each node's
    stage from its ready file, without asking the swarm, so the kill lands at the step asked)."""
    by_stage: dict[int, list] = {}
    for worker in workers:
        if worker.alive:
            by_stage.setdefault(worker.current_stage(), []).append(worker)
    spare = [replicas for _, replicas in sorted(by_stage.items()) if len(replicas) > 1]
    if not spare:
        print("no stage has a spare replica: not crashing anyone", file=sys.stderr)
        return {"step": step, "skipped": "no stage with a spare replica"}
    target = spare[0][0]
    swarm.kill(target)
    return {"step": step, "peer_id": target.peer_id, "stage": target.stage, "signal": "SIGKILL"}


def _wipe_stage(swarm, workers: list, entry: str, stage: int, step: int, node_args: list[str], workdir: Path) -> dict:
    """SIGKILL every replica of `stage` (its weights are gone with them) and start one new node for it,
    which has nothing to copy and rebuilds the stage from its neighbours."""
    holders = [w for w in workers if w.alive and w.current_stage() == stage]
    for holder in holders:
        swarm.kill(holder)
    index = len(workers)
    replacement = swarm.start_node(
        [entry], "--role", "worker", "--stage", str(stage), "--stats-file", str(workdir / f"stats-w{index}.json"),
        *node_args, wait=False, name=f"worker{index}",
    )  # fmt: skip
    workers.append(replacement)
    peer_ids = [h.peer_id for h in holders]
    return {"step": step, "stage": stage, "peer_ids": peer_ids, "signal": "SIGKILL", "replacement": replacement.name}
