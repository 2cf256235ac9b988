"""Is a change to the pipeline faster? Two revisions of shoal, one swarm each, in alternating pairs.

A single swarm run here varies by several per cent with the machine's other tenants, more than most
changes move, and two runs measured minutes apart compare the machine's moments as much as the code.
So this runs the same swarm (one replica per stage, one torch thread per node, on the same cores, as
`pipeline_efficiency.py`) of revision A and of revision B back to back, A first in the first, third,
... pair and B first in the others, and reports B ÷ A per pair, their median and spread, and how many pairs B won.

    python benchmarks/pipeline_ab.py c772708 HEAD --pairs 8      # ~8 min on tiny
    python benchmarks/pipeline_ab.py HEAD WORKTREE                # uncommitted changes against HEAD

Each revision is checked out into a temporary git worktree (WORKTREE: this checkout as it is, not
copied); that side's run starts from there, so its nodes import that revision's shoal, while both
sides are started, confined and measured by this checkout's harness (`swarm_run`). Both sides train
the same run file (same steps, data and seed), and the script asserts that; every microbatch is
counted, and a pair in which either side abandoned one fails the comparison (exit status 1).
Writes benchmarks/results/pipeline_ab.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import DOC, wall_time, write_section
from pipeline_efficiency import pin, side_rates, swarm_run

from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "pipeline_ab.json"
WORKTREE = "WORKTREE"


def checkout(rev: str, into: Path) -> tuple[Path, str]:
    """(where revision `rev` is checked out, its commit); WORKTREE is this checkout itself."""
    if rev == WORKTREE:
        head = git("rev-parse", "--short", "HEAD")
        dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        return ROOT, f"{head}{dirty}"
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}")
    path = into / commit
    if not path.exists():
        git("worktree", "add", "--detach", "--force", str(path), commit)
    return path, commit


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def one_side(tree: Path, run_file: Path, steps: int, out: Path) -> dict:
    """One swarm run of the revision checked out at `tree`: a child process started there, with that
    tree first on its path, so the nodes it starts (which inherit both) run that revision."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--one-side", str(run_file), str(steps), str(out)]
    subprocess.run(command, cwd=tree, env=env, check=True, timeout=120 + steps * 10)
    return json.loads(out.read_text())


def measure_one_side(run_file: str, steps: int, out: str) -> None:
    """Runs in the child: the swarm, on the cores this process inherited."""
    import shoal

    cores = set(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="shoal-ab-") as tmp:
        run = swarm_run(Path(run_file), steps, cores, Path(tmp))
    rates = side_rates(run, warmup=min(10, steps // 5))
    report = {
        "shoal_from": str(Path(shoal.__file__).resolve().parent.parent),
        "steps": run["steps"],
        "tokens_per_s": rates["steady_state"],
        "tokens_per_s_whole_run": rates["whole_run"],
        "cpu_s": run["cpu_s"],
        "abandoned": run["abandoned"],
        "abandoned_reasons": run["abandoned_reasons"],
        "microbatches": run["microbatches"],
        "final_loss": run["final_loss"],
    }
    Path(out).write_text(json.dumps(report))


def markdown(r: dict) -> str:
    a, b = r["a"]["label"], r["b"]["label"]
    rows = "\n".join(
        f"| {i + 1} | {p['first']} | {p['a']['tokens_per_s']:,.0f} | {p['b']['tokens_per_s']:,.0f} | {p['ratio']:.3f} |"
        for i, p in enumerate(r["pairs"])
    )
    verdict = (
        f"B ÷ A: **{r['median_ratio']:.3f}** median ({min(r['ratios']):.3f}–{max(r['ratios']):.3f} over "
        f"{len(r['pairs'])} pairs); "
        f"B was faster in {r['b_faster']} of {len(r['pairs'])} pairs."
    )
    return f"""## Pipeline A/B: two revisions, alternating

Reproduce: `{r["command"]}` ({wall_time(r["wall_s"])} here). Run `{r["run"]}`, one replica per stage,
{r["steps"]} steps per side, one torch thread per node, both sides on the same {len(r["cores"])} cores. A = `{a}`,
B = `{b}`; each pair runs both back to back, A first in odd pairs, B first in even ones. Tokens/s in steady
state (without the first {r["warmup_steps"]} steps).

| pair | first | A tokens/s | B tokens/s | B ÷ A |
|---|---|---|---|---|
{rows}

{verdict} Abandoned microbatches: {r["abandoned"]} of {r["microbatches"]} (both sides, all pairs).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", nargs="?", help="the baseline revision (a commit, a branch, HEAD, or WORKTREE)")
    parser.add_argument("b", nargs="?", help="the revision measured against it")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--run", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cores", type=int, default=None, help="the CPU budget of each side (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--section", default="pipeline-ab")
    parser.add_argument("--render-only", action="store_true", help="rewrite the docs section from --results")
    parser.add_argument("--one-side", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_side is not None:
        measure_one_side(args.one_side[0], int(args.one_side[1]), args.one_side[2])
        return 0
    if args.render_only:
        write_section(args.section, markdown(json.loads(args.results.read_text())), args.doc)
        return 0
    if args.a is None or args.b is None:
        parser.error("give two revisions, A (the baseline) and B")

    started = time.monotonic()
    cores = pin(args.cores)
    from shoal.model.corpus import default_corpus_path

    run = load_run_config(args.run)
    run = run.replace({"data.path": run.data.path or str(default_corpus_path()), "train.steps": args.steps,
                       "averaging.mode": "none"})  # fmt: skip
    trees = Path(tempfile.mkdtemp(prefix="shoal-ab-trees-"))
    try:
        (tree_a, label_a), (tree_b, label_b) = checkout(args.a, trees), checkout(args.b, trees)
        run_file = trees / "run.toml"
        run_file.write_text(run.to_toml())
        pairs = []
        for i in range(args.pairs):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            sides = {}
            for side in order:
                tree = tree_a if side == "a" else tree_b
                print(f"pair {i + 1}/{args.pairs}: {side.upper()} ...", file=sys.stderr)
                sides[side] = one_side(tree, run_file, args.steps, trees / f"{i}-{side}.json")
                assert sides[side]["shoal_from"] == str(tree.resolve()), f"side {side} ran {sides[side]['shoal_from']}"
            assert sides["a"]["steps"] == sides["b"]["steps"] == args.steps, "the sides trained unequal steps"
            ratio = sides["b"]["tokens_per_s"] / sides["a"]["tokens_per_s"]
            pairs.append({"first": order[0].upper(), "ratio": ratio, **sides})
    finally:
        for tree in trees.iterdir():
            if tree.is_dir():
                git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(trees, ignore_errors=True)
        git("worktree", "prune")

    ratios = [p["ratio"] for p in pairs]
    abandoned = sum(p[s]["abandoned"] for p in pairs for s in ("a", "b"))
    result = {
        "command": "python benchmarks/pipeline_ab.py " + " ".join(sys.argv[1:]),
        "run": args.run,
        "steps": args.steps,
        "warmup_steps": min(10, args.steps // 5),
        "cores": sorted(cores),
        "a": {"rev": args.a, "label": label_a},
        "b": {"rev": args.b, "label": label_b},
        "pairs": pairs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "b_faster": sum(r > 1 for r in ratios),
        "abandoned": abandoned,
        "microbatches": sum(p[s]["microbatches"] for p in pairs for s in ("a", "b")),
        "wall_s": time.monotonic() - started,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    write_section(args.section, markdown(result), args.doc)
    print(markdown(result))
    print(f"wrote {args.results} and {args.doc}", file=sys.stderr)
    if abandoned:
        print(f"FAILED: {abandoned} microbatches abandoned on loopback without faults", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
