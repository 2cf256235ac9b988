"""What a relay costs: the same swarm with its stage workers on public hosts, then behind two home NATs
reached through a relay, in one run of this script.

    .venv/bin/python benchmarks/relay.py                  # 3 rounds of both arms, tiny, 150 steps: ~5 min
    .venv/bin/python benchmarks/relay.py --rounds 1 --steps 60
    .venv/bin/python benchmarks/relay.py --run small --steps 20 --rounds 2   # megabyte hops: ~6 min

The NAT lab of tests/helpers/natlab.py (network namespaces, iptables MASQUERADE home routers; root
and iptables needed). Both arms: a bootstrap peer on public-0 (the relay), the data node on public-1,
one worker per block stage of the bundled `tiny` run (3 stages) with averaging off, 1 torch thread
each, same seed and data. **Direct**: the workers on public-2 and public-3. **Relayed**: on home-A-0
and home-B-0, each behind its own NAT: every hop between them crosses the relay (a home cannot dial
the other home), and the data node reaches them over the connections they dialed or the relay. The
arms alternate, so the machine's load falls on both alike.

Per arm: tokens/s over the steps after the first (warm-up), the median step time, the round-trip
time the stage-1 worker measured to the stage-2 worker (its link pings: relayed in the second arm),
microbatches lost (must be 0), and on the relay host: its p2pd's and its Python process's CPU
seconds and the bytes through its link while the data node trained, per trained token. `--run small` takes
the bundled `small` run instead (17 M parameters, int8 hops of 4 x 128 x 384: 197 kB each, past the
128 KiB at which p2pd cuts a relayed libp2p connection, so only shoal's stream relay carries them).
The links of
the lab are veth pairs with no latency or bandwidth limit: the relay's cost here is its processing
and the extra leg, not a slow path.

Writes benchmarks/results/relay.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section
from pipeline_efficiency import cpu_seconds, process_tree

from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until
from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.natlab import NatLab, unavailable_reason  # noqa: E402
from tests.helpers.tiny import write_tiny_run  # noqa: E402

RESULTS = {"tiny": ROOT / "benchmarks" / "results" / "relay.json",
           "small": ROOT / "benchmarks" / "results" / "relay_small.json"}  # fmt: skip
ARMS = ("direct", "relayed")


def one_arm(arm: str, lab: NatLab, run_file: Path, workdir: Path) -> dict:
    swarm = LocalSwarm(workdir, warm_start=False)
    relay_host, data_host = lab.hosts["public-0"], lab.hosts["public-1"]
    stage_hosts = ([lab.hosts["public-2"], lab.hosts["public-3"]] if arm == "direct"
                   else [lab.hosts["home-A-0"], lab.hosts["home-B-0"]])  # fmt: skip
    at = lambda host: ("--host-maddrs", f"/ip4/{host.ip}/tcp/0")  # noqa: E731
    try:
        relay = swarm.start_bootstrap(*at(relay_host), "--run-config", str(run_file), prefix=relay_host.command())
        entry = relay.maddrs[0]
        workers = [swarm.start_node([entry], *at(h), "--stage", str(s), prefix=h.command(), name=f"stage{s}")
                   for s, h in ((1, stage_hosts[0]), (2, stage_hosts[1]))]  # fmt: skip
        relayed = [any("/p2p-circuit/" in m for m in w.maddrs) for w in workers]
        assert relayed == [arm == "relayed"] * 2, (arm, [w.maddrs for w in workers])
        relay_pids = [relay.pid, *process_tree(relay.pid)]  # the bootstrap's Python process and its p2pd
        cpu0, bytes0 = [cpu_seconds(p) or 0.0 for p in relay_pids], lab.wan_bytes(relay_host)
        progress = workdir / "progress.jsonl"
        swarm.start_node([entry], *at(data_host), "--role", "data", "--progress-file", str(progress),
                         prefix=data_host.command(), name="data")  # fmt: skip
        done = wait_until(lambda: done_event(progress), 900, f"the {arm} arm to train")
        cpu1, bytes1 = [cpu_seconds(p) or 0.0 for p in relay_pids], lab.wan_bytes(relay_host)
        status = swarm.status(entry, prefix=data_host.command())
    finally:
        swarm.close()
    steps = [e for e in progress_events(progress) if e["event"] == "step"]
    tokens = sum(e["tokens"] for e in steps)
    ids = {n["stage"]: n for n in status["nodes"]}
    rtt = [2 * link["latency_s"] for link in ids[1]["links"] if link["peer_id"] == ids[2]["peer_id"]]
    return {
        "arm": arm,
        "steps": len(steps),
        "tokens": tokens,
        "tokens_per_s": sum(e["tokens"] for e in steps[1:]) / sum(e["step_s"] for e in steps[1:]),
        "step_s_median": statistics.median(e["step_s"] for e in steps[1:]),
        "stage1_to_stage2_rtt_s": rtt[0] if rtt else None,
        "microbatches_injected": done["microbatches_injected"],
        "microbatches_completed": done["microbatches_completed"],
        "microbatches_abandoned": done["microbatches_abandoned"],
        "final_loss": steps[-1]["loss"],
        "relay_python_cpu_s": cpu1[0] - cpu0[0],
        "relay_p2pd_cpu_s": sum(cpu1[1:]) - sum(cpu0[1:]),
        "relay_link_bytes": bytes1 - bytes0,
        "relay_link_bytes_per_token": (bytes1 - bytes0) / tokens,
        "workers_relayed": relayed,
    }


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        out[arm] = {key: {"median": statistics.median(r[key] for r in mine),
                          "min": min(r[key] for r in mine), "max": max(r[key] for r in mine)}
                    for key in ("tokens_per_s", "step_s_median", "relay_p2pd_cpu_s", "relay_python_cpu_s",
                                "relay_link_bytes_per_token")}  # fmt: skip
        rtts = [r["stage1_to_stage2_rtt_s"] for r in mine if r["stage1_to_stage2_rtt_s"] is not None]
        out[arm]["rtt_s_median"] = statistics.median(rtts) if rtts else None
        out[arm]["abandoned"] = sum(r["microbatches_abandoned"] for r in mine)
    pairs = list(zip([r for r in rows if r["arm"] == "direct"], [r for r in rows if r["arm"] == "relayed"],
                     strict=True))  # fmt: skip
    ratios = [rel["tokens_per_s"] / d["tokens_per_s"] for d, rel in pairs]
    out["relayed_over_direct_tokens_per_s"] = {"median": statistics.median(ratios), "min": min(ratios),
                                               "max": max(ratios), "each": ratios}  # fmt: skip
    return out


def markdown(result: dict) -> str:
    s, cfg = result["summary"], result["config"]
    ratio = s["relayed_over_direct_tokens_per_s"]

    def cell(arm: str, key: str, fmt: str) -> str:
        v = s[arm][key]
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}–{v['max']:{fmt}})"

    def finals(arm: str) -> str:
        return ", ".join(f"{r['final_loss']:.3f}" for r in result["rows"] if r["arm"] == arm)

    def rtt(arm: str) -> str:
        v = s[arm]["rtt_s_median"]
        return "–" if v is None else f"{1000 * v:.1f} ms"

    run = cfg.get("run_name", "tiny")
    command = "python benchmarks/relay.py" + ("" if run == "tiny" else f" --run {run} --steps {cfg['steps']} "
                                              f"--rounds {cfg['rounds']}")  # fmt: skip
    lines = [
        "## Relays: stage workers behind home NAT" + ("" if run == "tiny" else f" (`{run}`)"),
        "",
        f"`{command}` ({wall_time(result['wall_s'])}, {result['date']}): the bundled `{run}` run, "
        f"{cfg['steps']} steps, averaging off, one worker per block stage, {cfg['rounds']} rounds of each arm "
        "alternating, in the NAT lab of network namespaces (tests/helpers/natlab.py: two homes behind iptables "
        "MASQUERADE routers, links without latency or bandwidth limits). **Direct**: the two workers on public "
        "hosts. **Relayed**: each behind its own home NAT, so every hop between them crosses the relay (the "
        "bootstrap peer). Medians with (min–max) over the rounds.",
        "",
        "| arm | tokens/s | step time | stage 1 → 2 ping RTT | relay p2pd CPU s | relay Python CPU s | "
        "relay link bytes / token | microbatches lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        cpu = f"{cell(arm, 'relay_p2pd_cpu_s', '.2f')} | {cell(arm, 'relay_python_cpu_s', '.2f')}"
        lines.append(f"| {arm} | {cell(arm, 'tokens_per_s', ',.0f')} | {cell(arm, 'step_s_median', '.3f')} s | "
                     f"{rtt(arm)} | {cpu} | {cell(arm, 'relay_link_bytes_per_token', ',.0f')} | "
                     f"{s[arm]['abandoned']} |")  # fmt: skip
    lines += [
        "",
        f"Relayed ÷ direct tokens/s, paired by round: **{ratio['median']:.2f}** (min {ratio['min']:.2f}, max "
        f"{ratio['max']:.2f}). Final losses: direct "
        f"{finals('direct')}; relayed {finals('relayed')}. In the direct arm the relay host is "
        "only the bootstrap peer (DHT traffic); in the "
        "relayed arm its link carries everything between the homes twice (in and out): the hops, and the copies "
        "of each other's stage that neighbours keep as backups (every `repair.backup_every` steps), which outweigh "
        "the hops in a short run of `small`. No paper measures this: "
        "SWARM and Petals ask for an open port, Agora for port 49200. p2pd has no hole punching (DCUtR), so a "
        "relayed connection stays relayed (shoal/p2p/relay.py).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--run", choices=sorted(RESULTS), default="tiny", help="the bundled run to train")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the docs section from --results")
    args = parser.parse_args()
    args.results = args.results or RESULTS[args.run]
    section = "relay" if args.run == "tiny" else f"relay-{args.run}"
    if args.markdown_only:
        print(f"wrote {write_section(section, markdown(json.loads(args.results.read_text())), args.doc)}")
        return
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"relay.py: no NAT lab here: {reason}")
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shoal-relay-") as tmp, NatLab(public=4, homes={"A": 1, "B": 1}) as lab:
        overrides = {"train.steps": args.steps, "averaging.mode": "none", "train.eval_every": 10_000}
        if args.run == "tiny":
            run_file = write_tiny_run(Path(tmp), **overrides)
        else:
            run_file = Path(tmp) / "run.toml"
            dense = {**overrides, "averaging.codec": "float32"}  # top-k exchanges need averaging on
            run_file.write_text(load_run_config(args.run).replace(dense).to_toml())
        for round_ in range(args.rounds):
            for arm in ARMS:
                row = one_arm(arm, lab, run_file, Path(tmp) / f"{arm}-{round_}")
                assert row["steps"] == args.steps and row["microbatches_abandoned"] == 0, row
                assert row["microbatches_completed"] == row["microbatches_injected"], row
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    # like with like: the same steps on the same data, to the same loss (tiny: the same float sums up to
    # their order; small's runs differ among themselves, direct or relayed, by a few hundredths)
    losses = [r["final_loss"] for r in rows]
    assert max(losses) - min(losses) < (1e-3 if args.run == "tiny" else 0.15), losses
    result = {
        "what": "the same tiny swarm with its stage workers public (direct) or behind two home NATs (relayed)",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.monotonic() - started,
        "config": {
            "steps": args.steps,
            "rounds": args.rounds,
            "run_name": args.run,
            "run": "tiny (tests/helpers/tiny.py)" if args.run == "tiny" else f"bundled {args.run} (shoal/runs/)",
            "averaging": "none",
            "threads_per_node": 1,
        },  # fmt: skip
        "rows": rows,
        "summary": summarize(rows),
    }
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.results} and {write_section(section, markdown(result), args.doc)}")


if __name__ == "__main__":
    main()
