"""Where a pipeline's time goes: every node's compute jobs, traced on one clock, laid over each other.

Runs one swarm of a run (one replica per stage, the same cores and threads as
`pipeline_efficiency.py`) with `--compute-trace` on every node, then, over the steady-state steps,
measures how long 0, 1, 2, ... nodes were computing at once and, while only one was, which node and
which job: the pipeline's bubble, by name. Each job's thread CPU time beside its wall time says how
long it waited for a core (or the GIL) while it ran.

    python benchmarks/pipeline_trace.py            # ~1 min: tiny, 100 steps
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from docs_section import DOC, wall_time, write_section
from pipeline_efficiency import pin, side_rates, swarm_run

from shoal.run_files import load_run_config

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline_trace.json"


@dataclass(frozen=True)
class Job:
    start: float
    end: float
    name: str
    cpu_s: float


def read_trace(path: Path) -> list[Job]:
    jobs = []
    for line in path.read_text().splitlines():
        start, end, name, cpu_s = line.split()
        jobs.append(Job(float(start), float(end), name, float(cpu_s)))
    return sorted(jobs, key=lambda job: job.start)


def overlap(traces: dict[str, list[Job]], start: float, end: float) -> tuple[dict[int, float], Counter]:
    """Seconds in [start, end) during which k nodes computed at once (k -> s), and, while exactly one
    did, the seconds of each (node, job) that was alone."""
    events = []
    for node, jobs in traces.items():
        for job in jobs:
            a, b = max(job.start, start), min(job.end, end)
            if b > a:
                events += [(a, 1, node, job.name), (b, -1, node, job.name)]
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times an end comes before a start
    running: dict[str, str] = {}
    by_count: dict[int, float] = defaultdict(float)
    alone: Counter = Counter()
    last = start
    for at, change, node, name in events:
        by_count[len(running)] += at - last
        if len(running) == 1:
            alone[next(iter(running.items()))] += at - last
        last = at
        if change > 0:
            running[node] = name
        else:
            running.pop(node, None)
    by_count[len(running)] += end - last
    return dict(sorted(by_count.items())), alone


def analyse(traces: dict[str, list[Job]], step_node: str, warmup: int) -> dict:
    """The steady state is from the step node's optimizer step closing step `warmup` to its last."""
    step_starts = [job.start for job in traces[step_node] if job.name == "step"]
    assert len(step_starts) > warmup + 1, f"{len(step_starts)} steps traced, {warmup} of them warm-up"
    start, end = step_starts[warmup], step_starts[-1]
    steps = len(step_starts) - 1 - warmup
    by_count, alone = overlap(traces, start, end)
    window = end - start
    jobs = {}
    for node, node_jobs in traces.items():
        kinds = defaultdict(list)
        for job in node_jobs:
            if start <= job.start < end:
                kinds[job.name].append(job)
        jobs[node] = {
            name: {
                "per_step": len(js) / steps,
                "wall_ms": 1000 * statistics.median(j.end - j.start for j in js),
                "cpu_ms": 1000 * statistics.median(j.cpu_s for j in js),
            }
            for name, js in sorted(kinds.items())
        }
    return {
        "steps": steps,
        "step_ms": 1000 * window / steps,
        "step_ms_median": 1000 * statistics.median(b - a for a, b in itertools.pairwise(step_starts[warmup:])),
        "share_by_nodes_computing": {str(k): s / window for k, s in by_count.items()},
        "alone_ms_per_step": {f"{node} {name}": 1000 * s / steps for (node, name), s in alone.most_common()},
        "jobs": jobs,
    }


def markdown(r: dict) -> str:
    a = r["analysis"]
    shares = a["share_by_nodes_computing"]
    lines = [
        "## Pipeline trace: where the swarm's step goes",
        "",
        f"Reproduce: `{r['command']}` ({wall_time(r['wall_s'])} here). Run `{r['run']}`, one replica per stage "
        f"({r['stages']} stages, {r['microbatches_per_step']} microbatches per step), {r['steps']} steps on "
        f"{len(r['cores'])} cores, one torch thread per node, every node tracing its compute jobs "
        f"(`--compute-trace`); the first {r['warmup_steps']} steps left out. One run; {r['tokens_per_s']:,.0f} "
        f"tokens/s in steady state, {r['abandoned']} microbatches abandoned of {r['microbatches']}.",
        "",
        f"A step took {a['step_ms']:.0f} ms on average ({a['step_ms_median']:.0f} ms median). Share of that time "
        "during which so many nodes were computing:",
        "",
        "| nodes computing | " + " | ".join(shares) + " |",
        "|---|" + "---|" * len(shares),
        "| share of the step | " + " | ".join(f"{v:.0%}" for v in shares.values()) + " |",
        "",
        "While only one node computed (ms per step; the other cores had nothing of this pipeline to run):",
        "",
        "| node and job | ms per step |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in list(a["alone_ms_per_step"].items())[:8]],
        "",
        "Jobs per node (medians; wall against the thread's CPU time: the difference waited for a core or the GIL):",
        "",
        "| node | job | per step | wall ms | CPU ms |",
        "|---|---|---|---|---|",
    ]
    for node, kinds in a["jobs"].items():
        for name, k in kinds.items():
            lines.append(f"| {node} | {name} | {k['per_step']:.1f} | {k['wall_ms']:.1f} | {k['cpu_ms']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--cores", type=int, default=None, help="the CPU budget (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--render-only", action="store_true", help="rewrite the docs section from --results")
    args = parser.parse_args()
    if args.render_only:
        print(f"wrote {write_section('pipeline-trace', markdown(json.loads(args.results.read_text())), args.doc)}")
        return 0
    started = time.monotonic()
    cores = pin(args.cores)
    run = load_run_config(args.run)
    from shoal.model.corpus import default_corpus_path

    run = run.replace(
        {"data.path": run.data.path or str(default_corpus_path()), "train.steps": args.steps, "averaging.mode": "none"}
    )
    with tempfile.TemporaryDirectory(prefix="shoal-trace-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run_file.write_text(run.to_toml())
        trace_dir = workdir / "traces"
        trace_dir.mkdir()
        print(f"swarm: {args.steps} steps, traced ...", file=sys.stderr)
        swarm = swarm_run(run_file, args.steps, cores, workdir, trace_dir=trace_dir)
        traces = {path.stem: read_trace(path) for path in sorted(trace_dir.glob("*.txt"))}
    changed = [name for name in ("run", "steps", "warmup_steps") if getattr(args, name) != parser.get_default(name)]
    result = {
        "command": "python benchmarks/pipeline_trace.py"
        + "".join(f" --{name.replace('_', '-')} {getattr(args, name)}" for name in changed),
        "run": run.name,
        "stages": run.pipeline.stages,
        "microbatches_per_step": run.microbatches_per_step,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "cores": sorted(cores),
        "tokens_per_s": side_rates(swarm, args.warmup_steps)["steady_state"],
        "abandoned": swarm["abandoned"],
        "microbatches": swarm["microbatches"],
        "analysis": analyse(traces, "data", args.warmup_steps),
        "wall_s": time.monotonic() - started,
    }
    assert result["abandoned"] == 0, f"{result['abandoned']} microbatches abandoned: {swarm['abandoned_reasons']}"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["analysis"]["share_by_nodes_computing"]))
    print(f"wrote {args.results} and {write_section('pipeline-trace', markdown(result), args.doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
