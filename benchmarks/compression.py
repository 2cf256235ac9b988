"""Wire compression over a shaped link: what each activation/gradient codec saves in bytes, what it
costs in loss at equal steps, and the speed a 100 Mbit/s, 30 ms link leaves (issue 32).

    .venv/bin/python benchmarks/compression.py                 # tiny, 5 settings x 3 seeds, 60 steps: ~12 min
    .venv/bin/python benchmarks/compression.py --seeds 0 --steps 20   # a quick look

First the shaper itself (shoal/node/net/shaper.py; kernel netem is not available here): a bare framed
stream on loopback, 8 MiB through it and 20 one-frame round trips, against the configured shape.
Then, per setting (`pipeline.wire_dtype` float32, bfloat16 or int8 for activations and gradients;
`averaging.codec` float32, int8 or topk for NoLoCo's exchanges) and seed: the bundled `tiny` run, a
bootstrap peer, one data node and two replicas of each block stage, every node shaping its sends
with `--experiment-link 100:30`, 1 torch thread each, NoLoCo averaging as bundled. Equal steps, data
and seeds across settings. Reported, from every byte each node wrote to its streams (by kind):
pipeline, outer-exchange, control and all bytes per trained token, each ÷ float32's; validation
loss (mean and spread over seeds) and its
change against float32; tokens/s over the shaped link; abandoned microbatches (must be 0).
Writes benchmarks/results/compression.json and its section of docs/benchmarks.md.
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

from shoal.config import load_run_config
from shoal.demo.launcher import LocalSwarm, progress_events, wait_until

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compression.json"
LINK = "100:30"
# setting -> (pipeline.wire_dtype, averaging.codec); float32 first: the baseline every ratio is over
SETTINGS = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "float32"),
    "int8": ("int8", "float32"),
    "int8 + int8 outer": ("int8", "int8"),
    "int8 + topk outer": ("int8", "topk"),
}
KINDS = ("activation", "gradient", "outer", "copy", "audit", "control")  # every kind a node counts (WIRE_KINDS)


async def _bare_stream(link: str) -> dict:
    import torch

    from shoal.node.net import shaper
    from shoal.node.net.transport import FramedStream
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


def run_swarm(setting: str, seed: int, steps: int, workdir: Path) -> dict:
    wire, outer = SETTINGS[setting]
    overrides = {"train.steps": steps, "train.seed": seed, "pipeline.wire_dtype": wire, "averaging.codec": outer}
    run = load_run_config("tiny").replace(overrides)
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
    return {
        "setting": setting, "wire_dtype": wire, "outer_codec": outer, "seed": seed, "val_loss": done["val_loss"],
        "final_loss": done["final_loss"], "tokens": tokens,
        "tokens_per_s": tokens / sum(e["step_s"] for e in steps_done),
        "bytes_per_token": {kind: n / tokens for kind, n in sent.items()},
        "pipeline_bytes_per_token": (sent["activation"] + sent["gradient"]) / tokens,
        "outer_bytes_per_token": sent["outer"] / tokens, "total_bytes_per_token": sum(sent.values()) / tokens,
        "abandoned": done["microbatches_abandoned"], "microbatches": done["microbatches_injected"],
    }  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    by = {c: [r for r in runs if r["setting"] == c] for c in SETTINGS}
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
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "abandoned": sum(r["abandoned"] for r in rs),
        }  # fmt: skip
    return out


def markdown(r: dict) -> str:
    bare = r["shaper"]
    lines = [
        "## Wire compression over a shaped link (issue 32)",
        "",
        f"The shaper (`shoal/node/net/shaper.py`, `--experiment-link {LINK}`: 100 Mbit/s, 30 ms one way) on a bare "
        f"framed stream: 8 MiB took {bare['bulk_s']:.2f} s ({bare['bulk_mbit_per_s']:.0f} Mbit/s; the shape gives "
        f"{bare['bulk_expected_s']:.2f} s), and a one-frame message {bare['message_latency_ms']:.0f} ms (configured "
        f"{bare['configured_latency_ms']:.0f} ms).",
        "",
        f"`tiny`, 2 replicas per block stage, NoLoCo every 10 steps, {r['steps']} steps, seeds {r['seeds']}, every "
        "node shaping its sends. Bytes are every byte each node wrote to its streams (frames, requests and acks "
        "included; node/net/transport.py `WireBytes`), per trained token; the DHT's traffic is not counted.",
        "",
        "| setting (activations + outer exchange) | pipeline B/token (÷ fp32) | outer B/token (÷ fp32) | control "
        "B/token | all B/token (÷ fp32) | val loss, mean (spread) | val loss vs fp32 | tokens/s (shaped) | abandoned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, s in r["summary"].items():
        lines.append(
            f"| {setting} | {s['pipeline_bytes_per_token']:,.0f} ({s['pipeline_over_fp32']:.3f}) | "
            f"{s['outer_bytes_per_token']:,.0f} ({s['outer_over_fp32']:.3f}) | {s['control_bytes_per_token']:,.0f} | "
            f"{s['total_bytes_per_token']:,.0f} ({s['total_over_fp32']:.3f}) | {s['val_loss_mean']:.4f} "
            f"({s['val_loss_spread']:.4f}) | {100 * s['val_change_vs_fp32']:+.2f} % | {s['tokens_per_s']:,.0f} | "
            f"{s['abandoned']} |"
        )
    within = {k: s for k, s in r["summary"].items() if s["val_change_vs_fp32"] <= 0.01}
    name, best = min(within.items(), key=lambda kv: kv[1]["total_over_fp32"])
    verdict = "Met" if best["total_over_fp32"] <= 1 / 50 else "Not met"
    lines += [
        "",
        f"The issue's target is total bytes per trained token at most 1/50 of float32 (goal 1/100) within 1 % of "
        f"its loss. {verdict}: the best setting within 1 % of the loss is {name}, at {best['total_over_fp32']:.3f} "
        f"of float32 (1/{1 / best['total_over_fp32']:.1f}), {best['total_bytes_per_token']:,.0f} bytes a token where "
        f"1/50 is {r['summary']['float32']['total_bytes_per_token'] / 50:,.0f}. Activations and their gradients "
        "dominate what is left: int8 rows are 1/4 of float32 at best, and the 100x the anchors reach on activations "
        "needs a subspace codec (Protocol Models) that is not built. NoLoCo's exchange sends φ as well as Δ, and φ "
        "cannot be sparsified (it is the weights, not a change), so top-k on Δ leaves φ's int8 blocks as the floor "
        "of the outer bytes. Anchors: Protocol Models ~100x on activations (subspace projection), IOTA 128x, SWARM "
        "8-bit activations, SparseLoCo >146x on pseudo-gradients (DiLoCo-style, no φ), INTELLECT-1 int8 DiLoCo "
        "(400x less than DDP).",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/compression.py` ({wall_time(r['wall_s'])}, {r['machine']}).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    started = time.monotonic()
    bare = asyncio.run(_bare_stream(LINK))
    print(f"shaper: 8 MiB in {bare['bulk_s']:.2f} s (expected {bare['bulk_expected_s']:.2f}), "
          f"message {bare['message_latency_ms']:.0f} ms", flush=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="shoal-compression-") as tmp:
        for seed in args.seeds:
            for setting in SETTINGS:  # settings alternate within a seed, so machine noise hits them alike
                runs.append(run_swarm(setting, seed, args.steps, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    result = {"shaper": bare, "steps": args.steps, "seeds": args.seeds, "runs": runs, "summary": summarize(runs),
              "wall_s": time.monotonic() - started, "machine": machine}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(write_section("compression", markdown(result)))
    print(RESULTS)
    return 0 if all(r["abandoned"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
