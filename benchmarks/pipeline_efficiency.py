"""Pipeline efficiency: the swarm (one replica per stage) against the single-process trainer.

    .venv/bin/python benchmarks/pipeline_efficiency.py            # about 6 minutes on 2 cores

Measures, in one run and alternating so that machine noise hits both sides alike:
  - tokens/s of `shoal train --local` (2 threads, and 1) and of a real swarm on loopback (a
    bootstrap peer, one stage worker per block stage and one data node, 1 torch thread each);
  - bytes on the wire per microbatch, and peak resident memory of every node process;
  - the median per-hop latency of a 1 MiB activation through shoal's forward RPC against a bare
    hivemind (libp2p) stream between the same two processes;
  - stage-worker memory over a long run (1,000 microbatches): flat or growing.
Writes benchmarks/results/pipeline_efficiency.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section

from shoal.config import load_run_config
from shoal.demo.launcher import LocalSwarm, shoal_command, wait_until
from shoal.protocol.pipeline import Ack, ForwardRequest
from shoal.protocol.tensors import TensorSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "pipeline_efficiency.json"
HOP_BYTES = 1 << 20
HOP_REPEATS = 60


def local_run(run_file: Path, steps: int, threads: int, workdir: Path) -> dict:
    out = workdir / f"local-{threads}-{time.monotonic_ns()}"
    subprocess.run(
        shoal_command(
            "train",
            "--local",
            "--run-config",
            str(run_file),
            "--steps",
            str(steps),
            "--threads",
            str(threads),
            "--report",
            str(out),
            "--quiet",
        ),
        check=True,
        capture_output=True,
        timeout=1200,
    )
    report = json.loads((out / "report.json").read_text())
    return {"tokens_per_s": report["tokens_per_s"], "final_loss": report["final_loss"], "threads": threads}


def swarm_run(run_file: Path, steps: int, workdir: Path) -> dict:
    run = load_run_config(str(run_file))
    work = workdir / f"swarm-{time.monotonic_ns()}"
    swarm = LocalSwarm(work, log_level="WARNING")
    progress = work / "progress.jsonl"
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = [
            swarm.start_node(
                [entry], "--role", "worker", "--stats-file", str(work / f"w{i}.json"), wait=False, name=f"worker{i}"
            )
            for i in range(run.pipeline.stages - 1)
        ]
        for worker in workers:
            swarm.wait_ready(worker)
        swarm.start_node(
            [entry],
            "--role",
            "data",
            "--progress-file",
            str(progress),
            "--stats-file",
            str(work / "data.json"),
            name="data",
        )

        def finished() -> dict | None:
            lines = progress.read_text().splitlines() if progress.exists() else []
            return next((json.loads(x) for x in lines if '"event": "done"' in x), None)

        done = wait_until(finished, 60 + steps * 10.0, "the swarm to finish", interval_s=0.5)
    finally:
        swarm.close()
    stats = {
        p.name: json.loads((work / f"{'data' if p.name == 'data' else 'w' + p.name[6:]}.json").read_text())
        for p in swarm.peers
        if p.name != "bootstrap"
    }
    microbatches = done["microbatches_injected"]
    wire_bytes = sum(s["traffic"].get("bytes_sent", 0) for s in stats.values())
    return {
        "tokens_per_s": done["tokens_per_s"],
        "final_loss": done["final_loss"],
        "microbatches": microbatches,
        "abandoned": done["microbatches_abandoned"],
        "wire_bytes_per_microbatch": wire_bytes / microbatches,
        "peak_rss_mb": {name: round(s["peak_rss_bytes"] / 2**20, 1) for name, s in stats.items()},
        "rss_samples": {name: s["rss_samples"] for name, s in stats.items()},
    }


def memory_growth(samples: list[list[float]]) -> dict:
    """Resident memory early in the run (after warm-up) against the end: median of each fifth."""
    values = [rss for _, rss in samples]
    fifth = max(1, len(values) // 5)
    early, late = statistics.median(values[fifth : 2 * fifth]), statistics.median(values[-fifth:])
    return {
        "early_mb": round(early / 2**20, 1),
        "late_mb": round(late / 2**20, 1),
        "growth_mb": round((late - early) / 2**20, 1),
        "samples": len(values),
    }


# ---- per-hop latency: shoal's forward RPC vs a bare hivemind stream, same two processes ----------


class Sink:
    """The receiving end of shoal's forward RPC, minus the compute: read and check the tensor, ack."""

    async def rpc_forward(self, request: ForwardRequest, stream, peer) -> Ack:
        await stream.read_tensor(TensorSpec("float32", (None, None, None)))
        return Ack(accepted=True)


async def _serve_hop(ready_file: str) -> None:
    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.transport import serve

    async def bare(stream_info, reader, writer) -> None:
        header = await reader.readexactly(8)
        await reader.readexactly(int.from_bytes(header, "big"))
        writer.write(b"k")
        await writer.drain()
        writer.close()

    dht = await SwarmDHT.create(load_identity(None))
    await serve(dht.p2p, Sink())
    await dht.p2p.add_binary_stream_handler("bench.bare", bare)
    Path(ready_file).write_text(json.dumps({"maddrs": await dht.visible_maddrs(), "peer_id": dht.peer_id}))
    await asyncio.Event().wait()


async def _measure_hops(server: dict) -> dict:
    import torch

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.transport import open_call, read_reply
    from shoal.protocol.pipeline import Hop

    client = await SwarmDHT.create(load_identity(None), initial_peers=server["maddrs"], client_mode=True)
    tensor = torch.randn(4, HOP_BYTES // 4 // 4 // 128, 128)  # (B, T, C): a 1 MiB activation
    payload = tensor.numpy().tobytes()
    request = ForwardRequest(
        microbatch_id="bench", origin=client.peer_id, step=0, hop=0, route=(Hop(stage=1, peer_id=server["peer_id"]),)
    )
    shoal_s, bare_s = [], []
    try:
        for i in range(HOP_REPEATS + 5):
            started = time.perf_counter()
            stream = await open_call(client.p2p, server["peer_id"], "rpc_forward", 30)
            await stream.write_message(request)
            await stream.write_tensor(tensor, "float32")
            await read_reply(stream, Ack)
            stream.close()
            middle = time.perf_counter()
            from hivemind.p2p import PeerID

            _, reader, writer = await client.p2p.call_binary_stream_handler(
                PeerID.from_base58(server["peer_id"]), "bench.bare"
            )
            writer.write(len(payload).to_bytes(8, "big") + payload)
            await writer.drain()
            await reader.readexactly(1)
            writer.close()
            if i >= 5:  # warm-up
                shoal_s.append(middle - started)
                bare_s.append(time.perf_counter() - middle)
    finally:
        await client.shutdown()
    shoal_ms, bare_ms = statistics.median(shoal_s) * 1e3, statistics.median(bare_s) * 1e3
    return {
        "bytes": HOP_BYTES,
        "repeats": HOP_REPEATS,
        "shoal_rpc_median_ms": round(shoal_ms, 2),
        "bare_stream_median_ms": round(bare_ms, 2),
        "shoal_over_bare": round(shoal_ms / bare_ms, 2),
        "shoal_rpc_p90_ms": round(sorted(shoal_s)[int(0.9 * len(shoal_s))] * 1e3, 2),
        "bare_stream_p90_ms": round(sorted(bare_s)[int(0.9 * len(bare_s))] * 1e3, 2),
    }


def hop_latency(workdir: Path) -> dict:
    ready = workdir / "hop-server.json"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-hop", str(ready)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(ready.exists, 60, "the hop server")
        return asyncio.run(_measure_hops(json.loads(ready.read_text())))
    finally:
        server.kill()
        server.wait(timeout=10)


def ratios(swarms: list[dict], locals_: list[dict]) -> list[float]:
    """Swarm ÷ local tokens/s, pairing the runs of the same repeat (measured back to back)."""
    return [s["tokens_per_s"] / loc["tokens_per_s"] for s, loc in zip(swarms, locals_, strict=True)]


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def markdown(r: dict) -> str:
    ratios2, ratios1 = r["ratio_vs_local_2_threads"], r["ratio_vs_local_1_thread"]
    hop, mem = r["hop_latency"], r["memory_over_long_run"]
    peak = r["swarm_runs"][0]["peak_rss_mb"]
    lines = [
        "# Pipeline efficiency: the swarm against the single-process trainer",
        "",
        f"Reproduce: `{r['command']}` ({r['wall_s']:.0f} s here). Run `{r['run']}` "
        f"({r['params']:,} parameters, {r['stages']} stages, batch {r['batch']} sequences of {r['seq_len']} tokens in "
        f"{r['microbatches_per_step']} microbatches, float32 on the wire), {r['steps']} steps per measurement, "
        f"{r['repeats']} alternating repeats; median (min–max).",
        "",
        "| measurement | tokens/s | swarm ÷ this |",
        "|---|---|---|",
        f"| local trainer, 2 threads (all cores) | {spread([x['tokens_per_s'] for x in r['local_2_threads']], 0)} "
        f"| {spread(ratios2)} |",
        f"| local trainer, 1 thread | {spread([x['tokens_per_s'] for x in r['local_1_thread']], 0)} "
        f"| {spread(ratios1)} |",
        f"| swarm: bootstrap + {r['stages'] - 1} workers + 1 data node, 1 thread each "
        f"| {spread([x['tokens_per_s'] for x in r['swarm_runs']], 0)} | 1 |",
        "",
        f"Target: the swarm at ≥ 0.9 of the local trainer. Reached: **{statistics.median(ratios2):.2f}** of the "
        f"2-thread trainer (and {statistics.median(ratios1):.2f} of the 1-thread one).",
        "",
        f"- Bytes on the wire per microbatch (all hops, forward and backward): "
        f"{r['swarm_runs'][0]['wire_bytes_per_microbatch'] / 2**20:.2f} MiB "
        f"(one activation is {r['activation_bytes'] / 2**10:.0f} KiB).",
        f"- Per-hop latency of a 1 MiB activation, median of {hop['repeats']}: shoal forward RPC "
        f"{hop['shoal_rpc_median_ms']} ms (p90 {hop['shoal_rpc_p90_ms']}), bare hivemind stream "
        f"{hop['bare_stream_median_ms']} ms (p90 {hop['bare_stream_p90_ms']}) between the same two processes: "
        f"×{hop['shoal_over_bare']}.",
        "- Peak resident memory per process (MiB): " + ", ".join(f"{k} {v}" for k, v in peak.items()) + ".",
        f"- Stage-worker memory over {mem['microbatches']} microbatches: "
        + "; ".join(
            f"{k} {v['early_mb']} → {v['late_mb']} MiB ({v['growth_mb']:+.1f})" for k, v in mem["nodes"].items()
        )
        + ".",
        "",
        "What limits it (py-spy on the data node and a worker, wall-clock sampling): no process is CPU-bound — "
        "the data node's compute thread is busy about half the time, the workers' less. Stage 0 holds the "
        "embedding and the 4,096-way LM head, about half of this model's FLOPs, so it is the pipeline's "
        "slowest stage; with 4 microbatches per step and a step boundary that waits for the last gradient "
        "(needed for step-for-step parity), the fill and drain of a 3-hop ring leave the other stages idle; "
        f"and every hop opens a libp2p stream and waits for an acknowledgement (x{hop['shoal_over_bare']} a bare "
        "stream for 1 MiB). "
        "What would move it: one long-lived multiplexed stream per peer pair instead of a stream and an ack per "
        "hop; more microbatches per step, or letting the next step's forwards overlap this step's backward "
        "(which gives up step-for-step parity with the local trainer); and a split that does not leave the "
        "vocabulary-sized head and embedding alone on the data node.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long-steps", type=int, default=250, help="steps of the memory run (x microbatches)")
    parser.add_argument("--serve-hop", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_hop:
        asyncio.run(_serve_hop(args.serve_hop))
        return 0
    started = time.monotonic()
    run = load_run_config(args.run)
    from shoal.model.corpus import default_corpus_path

    run = run.replace({"data.path": run.data.path or str(default_corpus_path())})
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run_file.write_text(run.to_toml())
        local2, local1, swarms = [], [], []
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}: local ...", file=sys.stderr)
            local2.append(local_run(run_file, args.steps, 2, workdir))
            local1.append(local_run(run_file, args.steps, 1, workdir))
            print(f"repeat {repeat + 1}/{args.repeats}: swarm ...", file=sys.stderr)
            swarms.append(swarm_run(run_file, args.steps, workdir))
        print("hop latency ...", file=sys.stderr)
        hops = hop_latency(workdir)
        print(f"memory run: {args.long_steps} steps ...", file=sys.stderr)
        long_file = workdir / "long.toml"
        long_file.write_text(run.replace({"train.steps": args.long_steps}).to_toml())
        long_run = swarm_run(long_file, args.long_steps, workdir)

    params = run.model.params()
    result = {
        "command": "python benchmarks/pipeline_efficiency.py" + (f" --steps {args.steps}" if args.steps != 60 else ""),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "run": run.name,
        "params": params,
        "stages": run.pipeline.stages,
        "batch": run.train.batch_size,
        "seq_len": run.train.seq_len,
        "microbatches_per_step": run.microbatches_per_step,
        "steps": args.steps,
        "repeats": args.repeats,
        "activation_bytes": run.train.microbatch_size * run.train.seq_len * run.model.d_model * 4,
        "local_2_threads": local2,
        "local_1_thread": local1,
        "swarm_runs": [{k: v for k, v in s.items() if k != "rss_samples"} for s in swarms],
        "ratio_vs_local_2_threads": ratios(swarms, local2),
        "ratio_vs_local_1_thread": ratios(swarms, local1),
        "hop_latency": hops,
        "memory_over_long_run": {
            "microbatches": long_run["microbatches"],
            "abandoned": long_run["abandoned"],
            "nodes": {name: memory_growth(samples) for name, samples in long_run["rss_samples"].items()},
            "peak_rss_mb": long_run["peak_rss_mb"],
        },
        "wall_s": time.monotonic() - started,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    doc = write_section("pipeline", markdown(result))
    print(
        json.dumps(
            {k: result[k] for k in ("ratio_vs_local_2_threads", "ratio_vs_local_1_thread", "hop_latency")}, indent=2
        )
    )
    print(f"wrote {RESULTS.relative_to(ROOT)} and {doc.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
