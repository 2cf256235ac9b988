"""Join by copy under load: two joiners at once take a stage from its live replicas while the swarm
trains. Do they copy from different donors, how long does a copy take, and does a donor keep
training while it serves one?

    .venv/bin/python benchmarks/join_copy.py               # `small`, 3 rounds of 2 joiners: ~6 min
    .venv/bin/python benchmarks/join_copy.py --rounds 1    # a quick look

The swarm: a bootstrap peer, a data node training `small` (its stage 1 holds 4 blocks, 7.1 M
parameters: θ and φ are 57 MB on the wire per copy), two replicas of stage 1 (the donors) and one of
stage 2, 1 torch thread each, averaging off (the donors' weights do not wait on an exchange). Each
round starts two `--stage 1` joiners together, waits until both are active, and stops them.

Per copy: its donor and seconds (the joiner's "copying" and "copied" log lines). Per donor: its
tokens/s (backward passes x microbatch tokens, from its compute trace) during the copies it served
against the 10 s before the round, and the same for the donor that served none in that round if
any. The machine's 2 cores are shared by every process, the joiners' start-up included, so the
during/before ratio counts the joiners' import and measurement as well as the serving itself.
Writes benchmarks/results/join_copy.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.demo.launcher import LocalSwarm, progress_events, wait_until
from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "join_copy.json"
BEFORE_S = 10.0
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def monotonic_of(line: str, offset: float) -> float | None:
    """A log line's wall-clock stamp on the monotonic clock (every process of a machine shares it)."""
    found = LOG_TIME.match(line)
    if found is None:
        return None
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - offset


def copy_of(log: str, offset: float) -> dict:
    """The joiner's copy: donor, start and end on the monotonic clock."""
    start = end = donor = None
    for line in log.splitlines():
        if (m := re.search(r"copying stage 1 from (\S+)", line)) and start is None:
            start = monotonic_of(line, offset)
        if m := re.search(r"copied stage 1 from (\S+) \(inner step", line):
            end, donor = monotonic_of(line, offset), m.group(1)
    if start is None or end is None:
        raise RuntimeError(f"no copy in the joiner's log:\n{log[-3000:]}")
    return {"donor": donor, "start": start, "end": end, "seconds": end - start}


def backward_ends(trace: Path) -> list[float]:
    return [float(line.split()[1]) for line in trace.read_text().splitlines() if line.split()[2] == "_run_backward"]


def rate(ends: list[float], start: float, end: float, tokens: int) -> float:
    return tokens * sum(start <= e < end for e in ends) / max(end - start, 1e-9)


def run(rounds: int, workdir: Path, copy_delay_s: float) -> dict:
    run_config = load_run_config("small").replace({"train.steps": 100000, "averaging.mode": "none"})
    run_file = workdir / "run.toml"
    run_file.write_text(run_config.to_toml())
    tokens = run_config.train.microbatch_size * run_config.train.seq_len
    offset = time.time() - time.monotonic()
    swarm = LocalSwarm(workdir / "swarm", log_level="INFO")
    traces = {f"donor{i}": workdir / f"donor{i}.trace" for i in range(2)}
    rounds_out = []
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        slow = ("--inject-copy-delay", str(copy_delay_s)) if copy_delay_s else ()
        donors = [swarm.start_node([entry], "--stage", "1", "--compute-trace", str(traces[f"donor{i}"]), *slow,
                                   name=f"donor{i}") for i in range(2)]  # fmt: skip
        swarm.start_node([entry], "--stage", "2", name="stage2")
        progress = workdir / "progress.jsonl"
        swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), name="data")
        steps = lambda: sum(e["event"] == "step" for e in progress_events(progress))  # noqa: E731
        wait_until(lambda: steps() >= 5, 300, "the swarm to train")
        short = {d.peer_id[-8:]: f"donor{i}" for i, d in enumerate(donors)}
        for r in range(rounds):
            time.sleep(BEFORE_S)
            started = time.monotonic()
            joiners = [swarm.start_node([entry], "--stage", "1", wait=False, name=f"joiner{r}.{k}") for k in range(2)]
            for joiner in joiners:
                swarm.wait_ready(joiner, timeout_s=300)
            copies = [copy_of(j.log(), offset) for j in joiners]
            for joiner in joiners:
                swarm.stop(joiner)
            ends = {name: backward_ends(path) for name, path in traces.items()}
            per_donor = {}
            for name in traces:
                served = [c for c in copies if short.get(c["donor"]) == name]
                before = rate(ends[name], started - BEFORE_S, started, tokens)
                during = [rate(ends[name], c["start"], c["end"], tokens) for c in served]
                per_donor[name] = {"copies": len(served), "before_tokens_per_s": before,
                                   "during_tokens_per_s": statistics.mean(during) if during else None}  # fmt: skip
            rounds_out.append({"copies": [{**c, "donor": short.get(c["donor"], c["donor"])} for c in copies],
                               "donors": per_donor, "distinct_donors": len({c["donor"] for c in copies})})  # fmt: skip
            print(f"round {r}: copies from {[c['donor'] for c in rounds_out[-1]['copies']]}, "
                  f"{[round(c['seconds'], 2) for c in copies]} s", flush=True)  # fmt: skip
    finally:
        swarm.close()
    ratios = [d["during_tokens_per_s"] / d["before_tokens_per_s"] for r in rounds_out for d in r["donors"].values()
              if d["during_tokens_per_s"] is not None and d["before_tokens_per_s"]]  # fmt: skip
    seconds = [c["seconds"] for r in rounds_out for c in r["copies"]]
    return {
        "copy_delay_s": copy_delay_s,
        "run": "small",
        "stage_params": run_config.model.block_params() * 4,
        "copy_bytes": run_config.model.block_params() * 4 * 4 * 2,
        "rounds": rounds_out,
        "spread_rounds": sum(r["distinct_donors"] == 2 for r in rounds_out),
        "copy_seconds_median": statistics.median(seconds),
        "copy_seconds_range": [min(seconds), max(seconds)],
        "donor_during_over_before_median": statistics.median(ratios) if ratios else None,
        "donor_during_over_before_range": [min(ratios), max(ratios)] if ratios else None,
    }


def markdown(result: dict) -> str:
    first = result["variants"][0]
    lines = [
        "## Join by copy under load (issue 31)",
        "",
        f"`benchmarks/join_copy.py`: `small` training on loopback (a data node, two replicas of stage 1, one of "
        f"stage 2); in each round two `--stage 1` joiners start together and copy the stage "
        f"({first['stage_params'] / 1e6:.1f} M parameters, θ and φ: {first['copy_bytes'] / 2**20:.0f} MiB). A donor "
        "streams one copy at a time and turns a second joiner away to another replica (or to wait). On loopback a "
        "copy takes a fraction of a second; the second variant holds each copy at its donor for "
        f"{result['variants'][-1]['copy_delay_s']:g} s, as a ~150 Mbit/s uplink would take for these bytes.",
        "",
        "| variant | rounds | joiners at once copied from different donors | copy s, median (range) | donor tokens/s "
        "while serving ÷ the 10 s before, median (range) |",
        "|---|---|---|---|---|",
    ]
    for r in result["variants"]:
        ratio = r["donor_during_over_before_range"]
        rng = f"{ratio[0]:.2f}–{ratio[1]:.2f}" if ratio else "-"
        median = f"{r['donor_during_over_before_median']:.2f}" if ratio else "-"
        name = "loopback" if not r["copy_delay_s"] else f"copy held {r['copy_delay_s']:g} s"
        lines.append(
            f"| {name} | {len(r['rounds'])} | {r['spread_rounds']} of {len(r['rounds'])} | "
            f"{r['copy_seconds_median']:.2f} ({r['copy_seconds_range'][0]:.2f}–{r['copy_seconds_range'][1]:.2f}) | "
            f"{median} ({rng}) |"
        )
    lines += [
        "",
        "On loopback the two joiners' copies need not overlap (each takes about half a second), so both may "
        "take the same donor one after the other; when copies last (the second row) they overlap and the busy donor "
        "sends the second joiner to the other. A donor keeps training while it serves: the copy is a snapshot "
        "taken between two compute jobs, then streamed by the event loop. Every process shares the machine's "
        "2 cores, the joiners' start-up included, so the ratio is a lower bound for separate machines.",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/join_copy.py` ({wall_time(result['wall_s'])}, {result['machine']}).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copy-delay", type=float, default=4.0, help="the held variant's seconds per copy")
    args = parser.parse_args()
    started = time.monotonic()
    variants = []
    for delay in (0.0, args.copy_delay):
        with tempfile.TemporaryDirectory(prefix="shoal-join-copy-") as tmp:
            variants.append(run(args.rounds, Path(tmp), delay))
    result = {"variants": variants, "wall_s": time.monotonic() - started,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(write_section("join_copy", markdown(result)))
    print(RESULTS)
    held = variants[-1]
    return 0 if held["spread_rounds"] == len(held["rounds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
