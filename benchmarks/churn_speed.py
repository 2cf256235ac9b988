"""Fast churn: how much of its speed a swarm keeps when a node is SIGKILLed every K seconds, and where
the time after each kill goes.

    .venv/bin/python benchmarks/churn_speed.py                 # K = 30, 15, 7, 4, paired at 7, no kills: ~30 min
    .venv/bin/python benchmarks/churn_speed.py --steps 80 --every 15   # a quick look

The same swarm, run, data and seed each time: the bundled `tiny` run (3 stages), a bootstrap peer,
2 replicas of each block stage and one data node, as processes on loopback with 1 torch thread
each, record TTL 15 s. Without kills, then with a kill every K s: a random live node among the
workers *and the bootstrap peer* (the data node holds the run's data and loss, and is never a
target) is SIGKILLed, and started again RESTART_S later with the same flags (the bootstrap on the
same port with the same identity, so the address others know stays valid; workers with the
bootstrap and two live nodes as initial peers, in case the bootstrap is the one down).

In the paired mode a kill takes a random live worker, and PAIR_GAP_S later a live worker of an
adjacent block stage: two hops of the same microbatches, lost within a second of each other.

Per K: throughput (tokens over the data node's training time) ÷ the fault-free run's; step time
median / p90 / max; microbatches lost (must be 0); how each restarted worker got its stage back
(copied from a live replica, repaired from its neighbours, or started fresh: must be 0 after the
run has stepped); and per kill: **detection** (the kill to the data node suspecting the peer),
**start-up** (the restart's spawn to its "active" line), **join** (its stage chosen to active:
the copy or repair), **no replica** (seconds its stage had no active replica, from the processes
this script started and their "active" lines), and the **CPU** the restarted process spent until
it was active. Two cores are shared by every process here, so the restarts' start-up (importing
torch, starting libp2p, measuring its speed) is taken from the running swarm: "throughput ÷
fault-free, start-up told apart" subtracts the restarts' CPU-seconds ÷ 2 cores from the run's
time, an estimate of what separate machines would see.

Writes benchmarks/results/churn_speed.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from docs_section import wall_time, write_section
from pipeline_efficiency import cpu_seconds

from shoal.demo.launcher import LocalSwarm, Peer, done_event, progress_events
from shoal.run_files import FULL_PRECISION, load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "churn_speed.json"
TTL = "15"
RESTART_S = 3.0
PAIR_GAP_S = 0.5  # the paired mode: the second kill, of an adjacent block stage's worker, this much later
CORES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged_at(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_line(log: str, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
    for line in log.splitlines():
        if len(line) > 23 and line[4] == "-" and re.search(pattern, line):
            at = logged_at(line)
            if at >= after:
                return at, line
    return None


@dataclass
class Slot:
    """One place in the swarm (the bootstrap, or a worker of a stage) and the processes that held it."""

    name: str
    stage: int | None  # None: the bootstrap
    args: tuple[str, ...]
    lives: list[dict] = field(default_factory=list)  # per process: peer, spawned, active, killed, cpu
    peer: Peer | None = None


class ChurnSwarm:
    def __init__(self, run_file: Path, workdir: Path):
        self.run = load_run_config(str(run_file))
        self.run_file, self.workdir = run_file, workdir
        self.swarm = LocalSwarm(workdir, log_level="INFO")
        self.port = free_port()
        self.entry = ""
        self.slots: list[Slot] = []

    def start(self) -> None:
        boot = Slot("bootstrap", None, ("--run-config", str(self.run_file), "--record-ttl", TTL,
                                        "--host-maddrs", f"/ip4/127.0.0.1/tcp/{self.port}",
                                        "--identity", str(self.workdir / "bootstrap.key")))  # fmt: skip
        self.slots.append(boot)
        self._spawn(boot)
        for stage in range(1, self.run.pipeline.stages):
            for replica in range(2):
                slot = Slot(f"stage{stage}-{replica}", stage, ("--role", "worker", "--stage", str(stage),
                                                               "--record-ttl", TTL, "--threads", "1"))  # fmt: skip
                self.slots.append(slot)
                self._spawn(slot)
        for slot in self.slots[1:]:
            self.swarm.wait_ready(slot.peer)
            self._note_active(slot)

    def _spawn(self, slot: Slot) -> None:
        spawned = time.time()
        if slot.stage is None:
            slot.peer = self.swarm.start_bootstrap(*slot.args)  # returns once it prints its address
            self.entry = slot.peer.maddrs[0]
            slot.lives.append({"peer": slot.peer, "spawned": spawned, "active": time.time(), "killed": None,
                               "cpu": cpu_seconds(slot.peer.pid)})  # fmt: skip
            return
        live = [s.peer for s in self.slots if s is not slot and s.peer is not None and s.peer.alive]
        others = [maddrs[0] for maddrs in (peer.refresh().maddrs for peer in live) if maddrs]
        initial = [self.entry, *random.Random(len(slot.lives)).sample(others, min(2, len(others)))]
        slot.peer = self.swarm.start_node(initial, *slot.args, wait=False, name=slot.name)
        slot.lives.append({"peer": slot.peer, "spawned": spawned, "active": None, "killed": None, "cpu": None})

    def _note_active(self, slot: Slot) -> None:
        life = slot.lives[-1]
        if life["active"] is None and slot.peer is not None:
            found = first_line(slot.peer.log(), r"\] active: ")
            if found is not None:
                life["active"] = found[0]
                life["cpu"] = cpu_seconds(slot.peer.pid)

    def poll(self) -> None:
        for slot in self.slots:
            if slot.peer is not None and slot.peer.alive:
                self._note_active(slot)

    def kill(self, slot: Slot) -> dict:
        assert slot.peer is not None
        slot.peer.refresh()
        short = slot.peer.peer_id[-8:] if slot.peer.peer_id else ""
        self.swarm.kill(slot.peer)
        slot.lives[-1]["killed"] = time.time()
        return {"slot": slot.name, "stage": slot.stage, "killed": slot.lives[-1]["killed"], "peer": short}

    def restart(self, slot: Slot) -> None:
        self._spawn(slot)

    def close(self) -> None:
        for slot in self.slots:
            if slot.peer is not None and slot.peer.alive:
                self.swarm.stop(slot.peer)
        self.swarm.close(timeout_s=0)


def run_once(
    run_file: Path, workdir: Path, every_s: float | None, seed: int, timeout_s: float, paired: bool = False
) -> dict:
    swarm = ChurnSwarm(run_file, workdir)
    rng = random.Random(seed)
    kills: list[dict] = []
    pending: list[tuple[float, Slot]] = []
    partners: list[tuple[float, int]] = []  # the paired mode: (when, the stage whose neighbour to kill)
    steps_seen: dict[int, float] = {}
    progress = workdir / "progress.jsonl"
    try:
        swarm.start()
        data = swarm.swarm.start_node([swarm.entry], "--role", "data", "--record-ttl", TTL, "--threads", "1",
                                      "--progress-file", str(progress), name="data")  # fmt: skip
        started = time.time()
        next_kill = started + every_s if every_s else float("inf")
        while done_event(progress) is None:
            now = time.time()
            if now - started > timeout_s:
                raise RuntimeError(f"the run did not finish in {timeout_s:.0f} s")
            for event in progress_events(progress):
                if event["event"] == "step" and event["step"] not in steps_seen:
                    steps_seen[event["step"]] = now
            for due, slot in [p for p in pending if p[0] <= now]:
                pending.remove((due, slot))
                swarm.restart(slot)
            live = [s for s in swarm.slots if s.peer is not None and s.peer.alive and s.lives[-1]["active"]]
            for due, stage in [p for p in partners if p[0] <= now]:
                partners.remove((due, stage))
                adjacent = [s for s in live if s.stage is not None and abs(s.stage - stage) == 1]
                if adjacent:
                    slot = rng.choice(adjacent)
                    kills.append(swarm.kill(slot) | {"life": len(slot.lives) - 1, "paired": True})
                    pending.append((time.time() + RESTART_S, slot))
            if now >= next_kill:
                targets = [s for s in live if s.stage is not None] if paired else live
                if targets:
                    slot = rng.choice(targets)
                    kills.append(swarm.kill(slot) | {"life": len(slot.lives) - 1})
                    pending.append((time.time() + RESTART_S, slot))
                    if paired:
                        partners.append((time.time() + PAIR_GAP_S, slot.stage))
                next_kill += every_s
            swarm.poll()
            time.sleep(0.2)
        data_log = data.log()
        logs = {slot.name: [life["peer"].log() for life in slot.lives] for slot in swarm.slots}
        for slot in swarm.slots:  # before close() stops the rest: which processes ended on their own
            for life in slot.lives:
                life["exited"] = life["killed"] is None and life["peer"].process.poll() is not None
        swarm.close()
    finally:
        swarm.swarm.close(timeout_s=0)
    done = done_event(progress)
    steps = [e for e in progress_events(progress) if e["event"] == "step"]
    return {
        "every_s": every_s,
        "paired": paired,
        "done": done,
        "step_s": [e["step_s"] for e in steps],
        "kills": [explain(k, swarm, logs, data_log, steps, steps_seen) for k in kills],
        "restarts": joins(swarm, logs),
    }


def explain(kill: dict, swarm: ChurnSwarm, logs: dict, data_log: str, steps: list, seen: dict) -> dict:
    """Where the time after one kill went."""
    slot = next(s for s in swarm.slots if s.name == kill["slot"])
    at = kill["killed"]
    out = {"slot": kill["slot"], "stage": kill["stage"], "at_step": max((s for s, t in seen.items() if t <= at),
                                                                        default=-1)}  # fmt: skip
    suspected = first_line(data_log, rf"suspect {re.escape(kill['peer'])}:", after=at - 0.5) if kill["peer"] else None
    out["detection_s"] = round(suspected[0] - at, 2) if suspected else None
    nxt = kill["life"] + 1
    if nxt < len(slot.lives):
        life = slot.lives[nxt]
        out["startup_s"] = round(life["active"] - life["spawned"], 2) if life["active"] else None
        out["startup_cpu_s"] = life["cpu"]
        if slot.stage is not None:
            log = logs[slot.name][nxt]
            took = first_line(log, r"\] takes stage")
            out["join_s"] = round(life["active"] - took[0], 2) if took and life["active"] else None
    if slot.stage is not None:
        out["no_replica_s"] = round(no_replica_after(swarm, slot.stage, at), 2)
    return out


def no_replica_after(swarm: ChurnSwarm, stage: int, at: float) -> float:
    """Seconds after `at` (until the stage next had an active replica) that `stage` had none."""
    lives = [life for s in swarm.slots if s.stage == stage for life in s.lives]
    covered = sorted((life["active"], life["killed"] or float("inf")) for life in lives if life["active"])
    t = at
    for start, end in covered:
        if start <= t < end:
            return 0.0 if t == at else t - at
    upcoming = [start for start, _ in covered if start > at]
    return (min(upcoming) - at) if upcoming else 0.0


def joins(swarm: ChurnSwarm, logs: dict) -> dict:
    """How each restarted worker got its stage: copied, restored from a neighbour's backup, repaired
    (rebuilt by the run's rule), started fresh (from the initialisation, or with no word of either), it
    exited before it was active (with its last log line), or it was not active yet when the run ended."""
    counts = {"copied": 0, "restored from a backup": 0, "repaired": 0, "started fresh": 0, "failed to start": 0,
              "not active by the end": 0, "first start": 0}  # fmt: skip
    fresh: list[str] = []
    failed: list[str] = []
    for slot in swarm.slots:
        if slot.stage is None:
            continue
        for index, log in enumerate(logs[slot.name]):
            if index == 0:
                counts["first start"] += 1
            elif "] active: " not in log:
                life = slot.lives[index]
                if life.get("exited"):
                    counts["failed to start"] += 1
                    failed.append(next((line for line in reversed(log.splitlines()) if line.strip()), "")[-300:])
                else:
                    counts["not active by the end"] += 1
            elif "copied stage" in log:
                counts["copied"] += 1
            elif "restored from the backup" in log:
                counts["restored from a backup"] += 1
            elif "rebuilt by" in log:
                counts["repaired"] += 1
            else:
                counts["started fresh"] += 1
                fresh.append("\n".join(line for line in log.splitlines() if "stage" in line)[-1500:])
    return counts | {"fresh_logs": fresh, "failed_to_start": failed}


def tokens_trained(r: dict) -> float:
    return r["done"]["tokens_per_s"] * sum(r["step_s"])  # the done event's rate is over the steps' own time


def summarise(runs: dict, cores: int = CORES) -> dict:
    base = runs["no kills"]
    base_rate = tokens_trained(base) / base["done"]["train_s"]
    out = {}
    for name, r in runs.items():
        d = r["done"]
        step_s = sorted(r["step_s"])
        cpu = sum(k.get("startup_cpu_s") or 0.0 for k in r["kills"])
        train_s = d["train_s"]
        rate = tokens_trained(r) / train_s
        told_apart = tokens_trained(r) / max(train_s - cpu / cores, 1e-9)
        detections = [k["detection_s"] for k in r["kills"] if k.get("detection_s") is not None]
        out[name] = {
            "kills": len(r["kills"]),
            "throughput_over_fault_free": round(rate / base_rate, 3),
            "throughput_over_fault_free_startup_apart": round(told_apart / base_rate, 3),
            "step_s_median": round(statistics.median(step_s), 3),
            "step_s_p90": round(step_s[int(0.9 * (len(step_s) - 1))], 3),
            "step_s_max": round(step_s[-1], 3),
            "lost": d["microbatches_abandoned"],
            "restarts": r["restarts"],
            "detection_s_median": round(statistics.median(detections), 2) if detections else None,
            "startup_s_median": _median(r["kills"], "startup_s"),
            "join_s_median": _median(r["kills"], "join_s"),
            "no_replica_s_total": round(sum(k.get("no_replica_s") or 0.0 for k in r["kills"]), 1),
            "restart_cpu_s_total": round(cpu, 1),
            "train_s": round(train_s, 1),
        }
    return out


def _median(kills: list[dict], key: str) -> float | None:
    values = [k[key] for k in kills if k.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


def markdown(result: dict) -> str:
    s = result["summary"]
    rows = []
    for name, r in s.items():
        restarts = r["restarts"]
        rows.append(
            f"| {name} | {r['kills']} | **{r['throughput_over_fault_free']:.2f}** | "
            f"{r['throughput_over_fault_free_startup_apart']:.2f} | {r['step_s_median']:.2f} / {r['step_s_p90']:.2f} / "
            f"{r['step_s_max']:.1f} | {r['lost']} | {restarts['copied']} / "
            f"{restarts.get('restored from a backup', 0)} / {restarts['repaired']} / {restarts['started fresh']} | "
            f"{restarts.get('failed to start', 0)} | {_cell(r['detection_s_median'])} | "
            f"{_cell(r['startup_s_median'])} | "
            f"{_cell(r['join_s_median'])} | {r['no_replica_s_total']:.1f} | {r['restart_cpu_s_total']:.1f} | "
            f"{r['train_s']:.0f} |"
        )
    return "\n".join(
        [
            "## Fast churn: a node killed every K seconds, the bootstrap peer included",
            "",
            f"Reproduce: `{result['command']}` ({result['wall']}). The bundled `tiny` run, {result['steps']} steps, "
            f"a bootstrap peer, 2 replicas of each block stage and one data node on loopback (1 torch thread each, "
            f"{CORES} shared cores), record TTL {TTL} s; every K s a random live worker or the bootstrap is SIGKILLed "
            f"and started again {RESTART_S:.0f} s later with the same flags. One run per K (seed {result['seed']}): "
            "read differences of a few hundredths as noise. *Start-up told apart* subtracts the restarted processes' "
            "CPU-seconds until active, divided by the 2 cores, from the run's time: an estimate of what a user whose "
            "nodes restart on their own machines sees. Medians are over the kills of a run; *no replica* is the total "
            "time a killed worker's stage had no active replica. *Paired*: each kill takes a worker, and "
            f"{PAIR_GAP_S:g} s later a worker of an adjacent block stage. A stage left with no replica comes back "
            "from the backup its neighbouring stage keeps (`repair.backup_every`), else rebuilt by the run's rule.",
            "",
            "| K | kills | throughput ÷ fault-free | start-up told apart | step s: median / p90 / max | lost "
            "| restarts: copied / from a backup / rebuilt / fresh | failed to start | detection s | start-up s "
            "| join s | no replica s | restart CPU s | train s |",
            "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "*Detection* is the kill to the data node's `suspect` line (p2p/suspects.py: a dropped connection, "
            "then an unanswered ping); before suspects, a dead peer stayed in the views until its record "
            "expired or a send to it failed. A repair happens where both replicas of a stage were down at once "
            "(a kill within the other's restart); *no replica* is that time. What is left of the lost speed is "
            "mostly the restarts on the swarm's own two cores (*restart CPU*, about 1 CPU-second each until "
            "active, and the copy they then serve) and the step in which a kill lands (the p90 and max step "
            "times). Not side by side: before these changes, a run of this swarm with a kill about every 7 s "
            "(250 steps) kept 0.40 of its speed and restarted one stage from random weights (issue 36's figures).",
        ]
    )


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--every", type=float, nargs="*", default=[30.0, 15.0, 7.0, 4.0],
                        help="K: seconds between kills")  # fmt: skip
    parser.add_argument("--paired", type=float, nargs="*", default=[7.0],
                        help="K of the paired mode: a worker and, 0.5 s later, an adjacent stage's")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the saved JSON only")
    args = parser.parse_args()
    if args.render:
        text = markdown(json.loads(RESULTS.read_text()))
        write_section("churn-speed", text)
        print(text)
        return 0
    began = time.monotonic()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="shoal-churn-speed-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run_file.write_text(load_run_config("tiny").replace({**FULL_PRECISION, "train.steps": args.steps}).to_toml())
        arms = [(None, False), *((k, False) for k in args.every), *((k, True) for k in args.paired)]
        for every, paired in arms:
            name = "no kills" if every is None else f"every {every:g} s" + (", paired" if paired else "")
            folder = workdir / name.replace(" ", "-").replace(",", "")
            folder.mkdir()
            print(f"{name}: {args.steps} steps ...", file=sys.stderr, flush=True)
            runs[name] = run_once(run_file, folder, every, args.seed, args.timeout, paired)
            print(json.dumps(runs[name]["done"] and {k: runs[name]["done"][k] for k in
                                                     ("steps", "microbatches_abandoned", "train_s")}),
                  json.dumps(runs[name]["restarts"]), file=sys.stderr, flush=True)  # fmt: skip
    steps = {r["done"]["steps"] for r in runs.values()}
    assert steps == {args.steps}, f"every run must train the same steps: {steps}"
    result = {
        "command": " ".join(["python benchmarks/churn_speed.py", *(a for a in sys.argv[1:] if a != "--no-docs")]),
        "steps": args.steps,
        "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runs": runs,
    }
    result["summary"] = summarise(runs)
    result["wall_s"] = time.monotonic() - began
    result["wall"] = wall_time(result["wall_s"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    if not args.no_docs:
        write_section("churn-speed", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
