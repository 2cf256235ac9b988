"""Wire compression over a shaped link: what each activation/gradient codec saves in bytes, what it
costs in loss at equal steps, and the speed a 100 Mbit/s, 30 ms link leaves (issue 32).

    .venv/bin/python benchmarks/compression.py                 # tiny, 9 settings x 3 seeds, 60 steps: ~30 min
    .venv/bin/python benchmarks/compression.py --run small --settings "int8 + int8 outer" \
        "subspace 16 + int8 + topk outer"                      # small, 3 settings x 3 seeds
    .venv/bin/python benchmarks/compression.py --seeds 0 --steps 20   # a quick look

First the shaper itself (shoal/p2p/shaper.py; kernel netem is not available here): a bare framed
stream on loopback, 8 MiB through it and 20 one-frame round trips, against the configured shape.
Then, per setting (`pipeline.wire_dtype` float32, bfloat16 or int8 for activations and gradients;
`averaging.codec` float32, int8 or topk for NoLoCo's exchanges; `model.subspace_rank` k for a
Subspace Network, whose stages send k coefficients a token and the token ids) and seed: the bundled
run (`--run`), a bootstrap peer, one data node and two replicas of each block stage, every node
shaping its sends with `--experiment-link 100:30`, NoLoCo averaging as bundled, the defenses at
their defaults. Equal steps, data and seeds across settings. Reported, from every byte each node
wrote to its streams (by kind): pipeline, outer-exchange, control and training bytes per trained
token, each ÷ float32's, and the step audits' bytes apart (a defense's sampled cost, not training
traffic); validation loss (mean and spread over seeds) and its change against float32; tokens/s
over the shaped link; abandoned microbatches (must be 0). Writes benchmarks/results/compression.json
(compression-small.json for `--run small`) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import wall_time, write_section

from shoal.demo.launcher import LocalSwarm, progress_events, wait_until
from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compression.json"
LINK = "100:30"
# setting -> (pipeline.wire_dtype, averaging.codec, model.subspace_rank); float32 first: the baseline
# every ratio is over
SETTINGS = {
    "float32": ("float32", "float32", 0),
    "bfloat16": ("bfloat16", "float32", 0),
    "int8": ("int8", "float32", 0),
    "int8 + int8 outer": ("int8", "int8", 0),
    "int8 + topk outer": ("int8", "topk", 0),
    "subspace 8": ("float32", "float32", 8),
    "subspace 16 + int8 + topk outer": ("int8", "topk", 16),
    "subspace 8 + int8 + topk outer": ("int8", "topk", 8),
    "subspace 4 + int8 + topk outer": ("int8", "topk", 4),
}
KINDS = ("activation", "gradient", "outer", "copy", "audit", "control")  # every kind a node counts (WIRE_KINDS)
TRAINING_KINDS = ("activation", "gradient", "outer", "copy", "control")  # all but the step audits


async def _bare_stream(link: str) -> dict:
    import torch

    from shoal.p2p import shaper
    from shoal.p2p.streams import FramedStream
    from shoal.protocol.tensors import TensorSpec

    shape = shaper.LinkShape.parse(link)
    left, right = socket.socketpair()
    reader, keep = await asyncio.open_connection(sock=left)
    back_reader, writer = await asyncio.open_connection(sock=right)
    sender, receiver = FramedStream(None, writer, 30), FramedStream(reader, None, 30)  # type: ignore[arg-type]
    sender.peer = "receiver"
    payload = torch.zeros(2 * 2**20)  # 8 MiB of float32
    shaper.shape_links(shape)
    try:
        started = time.monotonic()
        reading = asyncio.ensure_future(receiver.read_tensor(TensorSpec("float32", (None,)), max_bytes=2**24))
        await sender.write_tensor(payload, "float32")
        await reading
        bulk_s = time.monotonic() - started
        one_way = []
        for _ in range(20):
            t0 = time.monotonic()
            await sender.write_frame(b"x")
            await receiver.read_frame()
            one_way.append(time.monotonic() - t0)
    finally:
        shaper.shape_links(None)
        writer.close()
        keep.close()
    expected_s = payload.nbytes / shape.bandwidth_bytes_per_s + shape.latency_s
    return {"link": link, "bulk_bytes": payload.nbytes, "bulk_s": bulk_s, "bulk_expected_s": expected_s,
            "bulk_mbit_per_s": payload.nbytes * 8 / bulk_s / 1e6,
            "message_latency_ms": 1e3 * statistics.median(one_way),
            "configured_latency_ms": 1e3 * shape.latency_s}  # fmt: skip


def run_swarm(run_name: str, setting: str, seed: int, steps: int, workdir: Path) -> dict:
    wire, outer, rank = SETTINGS[setting]
    overrides = {"train.steps": steps, "train.seed": seed, "pipeline.wire_dtype": wire, "averaging.codec": outer,
                 "model.subspace_rank": rank}  # fmt: skip
    run = load_run_config(run_name).replace(overrides)
    slug = setting.replace(" + ", "-").replace(" ", "-")
    run_file = workdir / f"{slug}-{seed}.toml"
    run_file.write_text(run.to_toml())
    work = workdir / f"swarm-{slug}-{seed}"
    swarm = LocalSwarm(work, log_level="WARNING")
    progress = work / "progress.jsonl"
    shaped = ("--experiment-link", LINK)
    names = []
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = []
        for stage in range(1, run.pipeline.stages):
            for k in range(2):
                name = f"s{stage}r{k}"
                names.append(name)
                stats_file = str(work / f"{name}.json")
                workers.append(swarm.start_node([entry], "--stage", str(stage), "--stats-file", stats_file, *shaped,
                                                wait=False, name=name))  # fmt: skip
        for worker in workers:
            swarm.wait_ready(worker)
        names.append("data")
        swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), "--stats-file",
                         str(work / "data.json"), *shaped, name="data")  # fmt: skip
        done = wait_until(lambda: next((e for e in progress_events(progress) if e["event"] == "done"), None),
                          600 + steps * 20.0, "the swarm to finish", interval_s=0.5)  # fmt: skip
        for peer in list(swarm.peers):
            if peer.name != "bootstrap":
                swarm.stop(peer)
    finally:
        swarm.close()
    stats = {n: json.loads((work / f"{n}.json").read_text()) for n in names}
    sent = {kind: sum(s["wire_bytes"][kind] for s in stats.values()) for kind in KINDS}  # every byte written
    steps_done = [e for e in progress_events(progress) if e["event"] == "step"]
    tokens = sum(e["tokens"] for e in steps_done)
    step_audits = done.get("step_audit") or {}
    phi_skipped = sum((s["engine"].get("averaging") or {}).get("phi_skipped", 0) for n, s in stats.items()
                      if n != "data")  # fmt: skip
    return {
        "setting": setting, "wire_dtype": wire, "outer_codec": outer, "subspace_rank": rank, "seed": seed,
        "val_loss": done["val_loss"], "final_loss": done["final_loss"], "tokens": tokens,
        "tokens_per_s": tokens / sum(e["step_s"] for e in steps_done),
        "bytes_per_token": {kind: n / tokens for kind, n in sent.items()},
        "pipeline_bytes_per_token": (sent["activation"] + sent["gradient"]) / tokens,
        "outer_bytes_per_token": sent["outer"] / tokens,
        "total_bytes_per_token": sum(sent[k] for k in TRAINING_KINDS) / tokens,
        "audit_bytes_per_token": sent["audit"] / tokens, "step_audits": step_audits, "phi_skipped": phi_skipped,
        "params": load_run_config(str(run_file)).model.params(),
        "abandoned": done["microbatches_abandoned"], "microbatches": done["microbatches_injected"],
    }  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    names = list(dict.fromkeys(r["setting"] for r in runs))
    by = {c: [r for r in runs if r["setting"] == c] for c in names}
    base = by["float32"]
    base_pipe = statistics.mean(r["pipeline_bytes_per_token"] for r in base)
    base_outer = statistics.mean(r["outer_bytes_per_token"] for r in base)
    base_total = statistics.mean(r["total_bytes_per_token"] for r in base)
    base_val = statistics.mean(r["val_loss"] for r in base)
    out = {}
    for setting, rs in by.items():
        vals = [r["val_loss"] for r in rs]
        pipe = statistics.mean(r["pipeline_bytes_per_token"] for r in rs)
        outer = statistics.mean(r["outer_bytes_per_token"] for r in rs)
        total = statistics.mean(r["total_bytes_per_token"] for r in rs)
        out[setting] = {
            "seeds": [r["seed"] for r in rs], "val_loss_mean": statistics.mean(vals),
            "val_loss_spread": (max(vals) - min(vals)) if len(vals) > 1 else 0.0,
            "val_change_vs_fp32": statistics.mean(vals) / base_val - 1.0,
            "pipeline_bytes_per_token": pipe, "pipeline_over_fp32": pipe / base_pipe,
            "outer_bytes_per_token": outer, "outer_over_fp32": outer / base_outer,
            "control_bytes_per_token": statistics.mean(r["bytes_per_token"]["control"] for r in rs),
            "total_bytes_per_token": total, "total_over_fp32": total / base_total,
            "audit_bytes_per_token": statistics.mean(r["audit_bytes_per_token"] for r in rs),
            "step_audits_failed": sum(r["step_audits"].get("failed", 0) for r in rs),
            "step_audits_passed": sum(r["step_audits"].get("passed", 0) for r in rs),
            "params": rs[0]["params"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "abandoned": sum(r["abandoned"] for r in rs),
        }  # fmt: skip
    return out


def markdown(r: dict) -> str:
    bare, run_name = r["shaper"], r["run"]
    lines = [
        f"## Wire compression over a shaped link, `{run_name}` (issue 32)",
        "",
        f"The shaper (`shoal/p2p/shaper.py`, `--experiment-link {LINK}`: 100 Mbit/s, 30 ms one way) on a bare "
        f"framed stream: 8 MiB took {bare['bulk_s']:.2f} s ({bare['bulk_mbit_per_s']:.0f} Mbit/s; the shape gives "
        f"{bare['bulk_expected_s']:.2f} s), and a one-frame message {bare['message_latency_ms']:.0f} ms (configured "
        f"{bare['configured_latency_ms']:.0f} ms).",
        "",
        f"`{run_name}`, 2 replicas per block stage, NoLoCo every 10 steps, {r['steps']} steps, seeds {r['seeds']}, "
        "every node shaping its sends, the defenses at their defaults. Bytes are every byte each node wrote to its "
        "streams (frames, requests and acks included; p2p/transport.py `WireBytes`), per trained token: "
        "training bytes are activations, gradients, outer exchanges, copies and control messages; the step audits' "
        "transcripts (a defense sampling 1 step in 10, not training traffic) are counted apart; the DHT's traffic "
        "is not counted. `subspace k`: a Subspace Network (`model.subspace_rank = k`, shoal/model/llama.py), whose "
        "stages send k coefficients a token and the token ids (2 bytes a token) instead of the d-wide stream.",
        "",
        "| setting | params | pipeline B/token (÷ fp32) | outer B/token (÷ fp32) | control B/token | training B/token "
        "(÷ fp32) | step audits B/token | val loss, mean (spread) | val loss vs fp32 | tokens/s (shaped) | "
        "abandoned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, s in r["summary"].items():
        lines.append(
            f"| {setting} | {s['params'] / 1e6:.2f} M | {s['pipeline_bytes_per_token']:,.0f} "
            f"({s['pipeline_over_fp32']:.3f}) | {s['outer_bytes_per_token']:,.1f} ({s['outer_over_fp32']:.3f}) | "
            f"{s['control_bytes_per_token']:,.1f} | {s['total_bytes_per_token']:,.0f} ({s['total_over_fp32']:.4f}, "
            f"1/{1 / s['total_over_fp32']:.0f}) | {s['audit_bytes_per_token']:,.0f} | {s['val_loss_mean']:.4f} "
            f"({s['val_loss_spread']:.4f}) | {100 * s['val_change_vs_fp32']:+.2f} % | {s['tokens_per_s']:,.0f} | "
            f"{s['abandoned']} |"
        )
    summary = r["summary"]
    within = {k: s for k, s in summary.items() if s["val_change_vs_fp32"] <= 0.01}
    name, best = min(within.items(), key=lambda kv: kv[1]["total_over_fp32"])
    verdict = "Met" if best["total_over_fp32"] <= 1 / 50 else "Not met"
    goal = "It meets the goal of 1/100 as well. " if best["total_over_fp32"] <= 1 / 100 else ""
    base_total = summary["float32"]["total_bytes_per_token"]
    misses = [f"{k} (1/{1 / s['total_over_fp32']:.0f}, {100 * s['val_change_vs_fp32']:+.2f} %)"
              for k, s in summary.items() if k != "float32" and not (s["total_over_fp32"] <= 1 / 50
                                                                    and s["val_change_vs_fp32"] <= 0.01)]  # fmt: skip
    audits = sum(s["step_audits_passed"] for s in summary.values())
    failed = sum(s["step_audits_failed"] for s in summary.values())
    lines += [
        "",
        f"The issue's target is training bytes per trained token at most 1/50 of float32's (goal 1/100) within 1 % "
        f"of its validation loss. {verdict} on `{run_name}`: the best setting within 1 % of the loss is {name}, at "
        f"{best['total_over_fp32']:.4f} of float32 (1/{1 / best['total_over_fp32']:.0f}; "
        f"{best['total_bytes_per_token']:,.1f} bytes a token where 1/50 is {base_total / 50:,.0f}), "
        f"{100 * best['val_change_vs_fp32']:+.2f} % in loss. {goal}"
        f"Settings that miss the target (ratio, loss against float32): {', '.join(misses) or 'none'}. "
        f"Step audits over every run: {audits} passed, {failed} failed.",
        "",
        "Anchors: Protocol Models (Subspace Networks) ~100x on activations at no loss in convergence at 80 Mbit/s; "
        "IOTA 128x; SWARM 8-bit activations; SparseLoCo >146x on pseudo-gradients (1-3 % top-k at 2 bits, "
        "error feedback; DiLoCo-style, no φ); INTELLECT-1 int8 DiLoCo (400x less than DDP).",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/compression.py{r['command']}` ({wall_time(r['wall_s'])}, "
        f"{r['machine']}).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    settings = ["float32", *(s for s in args.settings if s != "float32")]  # the baseline always runs
    started = time.monotonic()
    bare = asyncio.run(_bare_stream(LINK))
    print(f"shaper: 8 MiB in {bare['bulk_s']:.2f} s (expected {bare['bulk_expected_s']:.2f}), "
          f"message {bare['message_latency_ms']:.0f} ms", flush=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="shoal-compression-") as tmp:
        for seed in args.seeds:
            for setting in settings:  # settings alternate within a seed, so machine noise hits them alike
                runs.append(run_swarm(args.run, setting, seed, args.steps, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    command = "" if args.run == "tiny" and settings == list(SETTINGS) else (
        f" --run {args.run} --settings " + " ".join(f'"{s}"' for s in settings[1:]))  # fmt: skip
    result = {"run": args.run, "shaper": bare, "steps": args.steps, "seeds": args.seeds, "runs": runs,
              "summary": summarize(runs), "wall_s": time.monotonic() - started, "machine": machine,
              "command": command}  # fmt: skip
    path = RESULTS if args.run == "tiny" else RESULTS.with_name(f"compression-{args.run}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(write_section("compression" if args.run == "tiny" else f"compression-{args.run}", markdown(result)))
    print(path)
    return 0 if all(r["abandoned"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
