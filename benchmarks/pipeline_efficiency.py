"""Pipeline efficiency: the swarm (one replica per stage) against the single-process trainer, at
equal steps, on the same data, with the same CPU budget.

    .venv/bin/python benchmarks/pipeline_efficiency.py            # about 10 minutes on 2 idle cores
    .venv/bin/python benchmarks/pipeline_efficiency.py --cores 1  # both sides on one core

The same CPU budget means the same set of K cores: the benchmark confines itself to K cores
(`--cores`, default: every core it may use) before it starts anything, so that every process it
starts inherits that affinity: the local trainer (K torch threads, the trainer of `shoal train
--local`, in one process) and every process of the swarm (the bootstrap peer, the stage workers,
the data node, 1 torch thread each, and their p2pd daemons). The script asserts the affinity of
every one of those processes and the local trainer's thread count, and measures the CPU seconds
each side used, so the reader can see how much of its budget each side spent.

Measures, alternating the two sides (and which goes first) so that machine noise hits both alike:
  - tokens/s of both sides over the same steps: whole run and steady state (after a warm-up);
  - loss parity: the swarm's loss against the local trainer's, step by step;
  - every microbatch the swarm abandoned, with its reasons (a fault-free run on loopback that loses
    one fails the benchmark: exit status 1, after the results are written);
  - bytes on the wire per microbatch, and CPU use and peak resident memory of every swarm process;
  - a 1 MiB hop through shoal's forward RPC against a bare hivemind stream between the same two
    processes, alternating, with where the shoal hop's time goes (open, send, acknowledgement);
  - stage-worker memory over a long run (1,000 training microbatches): flat or growing, and its
    abandoned microbatches.
Writes benchmarks/results/pipeline_efficiency.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from docs_section import DOC, wall_time, write_section

from shoal.config import WIRE_DTYPES
from shoal.demo.launcher import LocalSwarm, progress_events, wait_until
from shoal.node.compute import COMPUTE_THREAD_OS_NAME
from shoal.protocol.pipeline import Ack, ForwardRequest
from shoal.protocol.tensors import TensorSpec
from shoal.run_files import load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "pipeline_efficiency.json"
HOP_BYTES = 1 << 20
HOP_REPEATS = 60
HOP_WARMUP = 5
HOP_TARGET = 1.1  # issue 13: a 1 MiB hop at most 1.1 x a bare hivemind stream
# The local trainer is CPU-bound by construction: below this share of its cores, something else was using
# them while it ran, and the ratio would measure the machine's load, not shoal.
MIN_LOCAL_CPU_SHARE = 0.9
PARITY_TOLERANCE = 1e-3  # per-step loss gap taken as "the same" (float sums in another order)
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- the CPU budget: one set of cores for everything this benchmark starts --------------------------


def process_tree(root: int) -> list[int]:
    """`root`'s descendants (children, grandchildren ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads); None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of stat)


def compute_thread_seconds(pid: int) -> float:
    """CPU seconds of a node's compute thread (its torch work), found by the name the node gives it."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if name == COMPUTE_THREAD_OS_NAME:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def cpu_split(cpu: dict[str, float], compute_s: float, budget_s: float) -> dict[str, float]:
    """Shares of the swarm's CPU budget: the nodes' compute threads, the rest of their processes (event
    loop: streams, codec, DHT; and the bootstrap peer), their p2pd daemons, and what nobody used."""
    p2pd = sum(v for name, v in cpu.items() if name.endswith("/p2pd"))
    used = sum(cpu.values())
    return {
        "compute_threads": compute_s / budget_s,
        "other_threads": (used - p2pd - compute_s) / budget_s,
        "p2pd": p2pd / budget_s,
        "idle": 1 - used / budget_s,
    }


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def assert_confined(pids: list[int], cores: set[int], what: str) -> None:
    for pid in pids:
        try:
            allowed = os.sched_getaffinity(pid)
        except ProcessLookupError:
            continue
        assert allowed == cores, (
            f"CPU budget broken: {what} process {pid} ({command_name(pid)}) may run on cores {sorted(allowed)}, "
            f"not exactly the benchmark's {sorted(cores)}"
        )


def tokens_per_s(steps: list[dict], skip: int = 0) -> float:
    kept = steps[skip:]
    return sum(s["tokens"] for s in kept) / sum(s["seconds"] for s in kept)


# ---- the local side: the reference trainer of `shoal train --local`, in its own process -------------


def local_worker(run_file: str, threads: int, out: str) -> None:
    """Runs in a child process: train `run_file` with `threads` torch threads; write every step."""
    import torch

    from shoal.train.data import load_token_splits
    from shoal.train.reference import ReferenceTrainer

    torch.set_num_threads(threads)
    run = load_run_config(run_file)
    trainer = ReferenceTrainer(run, load_token_splits(run.data, run.model.vocab_size))
    tokens = run.train.batch_size * run.train.seq_len
    cpu = [time.process_time()]  # at the start and at the end of each step: evaluation left out
    result = trainer.train(lambda record: cpu.append(time.process_time()))
    cpu_s = cpu[-1] - cpu[0]
    steps = [{"loss": r.loss, "tokens": tokens, "seconds": tokens / r.tokens_per_s} for r in result.history]
    report = {"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0)), "cpu_s": cpu_s,
              "wall_s": result.wall_s, "final_loss": result.final_loss, "steps": steps}  # fmt: skip
    Path(out).write_text(json.dumps(report))


def local_run(run_file: Path, cores: set[int], workdir: Path) -> dict:
    out = workdir / f"local-{time.monotonic_ns()}.json"
    subprocess.run(
        [sys.executable, __file__, "--local-worker", str(run_file), str(len(cores)), str(out)],
        cwd=ROOT,
        check=True,
        timeout=1800,
    )
    report = json.loads(out.read_text())
    assert report["threads"] == len(cores), f"CPU budget broken: local trainer ran {report['threads']} threads"
    assert set(report["cores"]) == cores, f"CPU budget broken: local trainer on cores {report['cores']}"
    steps = report.pop("steps")
    return {
        **report,
        "steps": len(steps),
        "losses": [s["loss"] for s in steps],
        "step_s": [s["seconds"] for s in steps],
        "tokens_per_step": steps[0]["tokens"],
        "cpu_share": report["cpu_s"] / (report["wall_s"] * len(cores)),
    }


# ---- the swarm side ----------------------------------------------------------------------------------


def swarm_run(
    run_file: Path, steps: int, cores: set[int], workdir: Path, threads: int = 1, trace_dir: Path | None = None
) -> dict:
    """One swarm run; with `trace_dir`, every node traces its compute jobs to `trace_dir/<name>.txt`."""
    run = load_run_config(str(run_file))

    def traced(name: str) -> list[str]:
        return ["--compute-trace", str(trace_dir / f"{name}.txt")] if trace_dir is not None else []

    assert run.train.steps == steps, f"run file trains {run.train.steps} steps, not {steps}"
    work = workdir / f"swarm-{time.monotonic_ns()}"
    swarm = LocalSwarm(work, log_level="WARNING")
    progress = work / "progress.jsonl"
    cpu_at: dict[str, dict[int, float]] = {}
    wall_at: dict[str, float] = {}
    compute_at: dict[str, float] = {}
    names: dict[int, str] = {}
    try:
        entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
        workers = [
            swarm.start_node(
                [entry],
                "--role",
                "worker",
                "--stats-file",
                str(work / f"worker{i}.json"),
                "--threads",
                str(threads),
                *traced(f"worker{i}"),
                wait=False,
                name=f"worker{i}",
            )
            for i in range(run.pipeline.stages - 1)
        ]
        for worker in workers:
            swarm.wait_ready(worker)
        swarm.start_node(
            [entry], "--role", "data", "--progress-file", str(progress), "--stats-file", str(work / "data.json"),
            "--threads", str(threads), *traced("data"), name="data",
        )  # fmt: skip

        def snapshot(label: str) -> None:
            """CPU seconds of every process of the swarm (p2pd daemons named after their node)."""
            for peer in swarm.peers:
                names[peer.pid] = peer.name
                for child in process_tree(peer.pid):
                    names[child] = f"{peer.name}/{command_name(child)}"
            cpu_at[label] = {pid: s for pid in names if (s := cpu_seconds(pid)) is not None}
            compute_at[label] = sum(compute_thread_seconds(peer.pid) for peer in swarm.peers)
            wall_at[label] = time.monotonic()

        def watch() -> dict | None:
            events = progress_events(progress)
            kinds = Counter(e["event"] for e in events)
            if kinds["start"] and "start" not in cpu_at:
                snapshot("start")
                everyone = [p.pid for p in swarm.peers] + [c for p in swarm.peers for c in process_tree(p.pid)]
                assert_confined(everyone, cores, "swarm")
            if kinds["step"] == steps and "end" not in cpu_at:
                snapshot("end")
            if kinds["done"]:
                return next(e for e in events if e["event"] == "done")
            for peer in swarm.peers:
                if not peer.alive:
                    raise RuntimeError(f"{peer.name} exited with {peer.process.returncode}:\n{peer.log()[-3000:]}")
            return None

        done = wait_until(watch, 120 + steps * 10.0, "the swarm to finish", interval_s=0.2)
    except BaseException:
        swarm.close()
        kept = Path(tempfile.mkdtemp(prefix="shoal-bench-failed-"))
        shutil.copytree(work, kept, dirs_exist_ok=True)
        print(f"the swarm run failed: its logs and progress file are kept in {kept}", file=sys.stderr)
        raise
    finally:
        swarm.close()
    step_events = [e for e in progress_events(progress) if e["event"] == "step"]
    stats = {p.name: json.loads((work / f"{p.name}.json").read_text()) for p in swarm.peers if p.name != "bootstrap"}
    wall = wall_at["end"] - wall_at["start"]
    cpu = {names[pid]: cpu_at["end"][pid] - cpu_at["start"].get(pid, 0.0) for pid in cpu_at["end"]}
    microbatches = done["microbatches_injected"]
    return {
        "steps": done["steps"],
        "losses": [e["loss"] for e in step_events],
        "step_s": [e["step_s"] for e in step_events],
        "step_tokens": [e["tokens"] for e in step_events],
        "final_loss": done["final_loss"],
        "microbatches": microbatches,
        "abandoned": done["microbatches_abandoned"],
        "abandoned_reasons": done["abandoned_reasons"],
        "in_flight_at_end": done["microbatches_in_flight"],
        "resent": done["microbatches_resent"],
        "backward_recoveries": done["backward_recoveries"],
        "workers": {
            name: {k: s["engine"].get(k) for k in ("expired", "refused", "stream_retries", "recomputed")}
            for name, s in stats.items()
            if name != "data"
        },
        "cpu_s": round(sum(cpu.values()), 2),
        "cpu_s_by_process": {k: round(v, 2) for k, v in sorted(cpu.items())},
        "cpu_share": sum(cpu.values()) / (wall * len(cores)),
        "cpu_split": cpu_split(cpu, compute_at["end"] - compute_at["start"], wall * len(cores)),
        "wall_s": wall,
        "wire_bytes_per_microbatch": sum(s["traffic"].get("bytes_sent", 0) for s in stats.values()) / microbatches,
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
    """The receiving end of shoal's forward RPC, minus the compute: read and check the tensor, ack.
    It times its read (frames, assembly, the finiteness and magnitude check) for the breakdown."""

    spec = TensorSpec("float32", (None, None, None), 65504.0)  # a node's activation spec (hops.WIRE_MAX_ABS)

    def __init__(self) -> None:
        self.read_s: list[float] = []

    async def forward(self, request: ForwardRequest, stream, sender: str) -> Ack:
        started = time.perf_counter()
        await stream.read_tensor(self.spec)
        self.read_s.append(time.perf_counter() - started)
        return Ack(accepted=True)


async def _serve_hop(ready_file: str) -> None:
    import torch

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.rpcs import EngineRpcs
    from shoal.p2p.rpc import serve

    torch.set_num_threads(1)  # as a node runs (`shoal node --threads 1`): more threads only wait for a core
    sink = Sink()

    async def bare(stream_info, reader, writer) -> None:
        header = await reader.readexactly(8)
        await reader.readexactly(int.from_bytes(header, "big"))
        writer.write(b"k")
        await writer.drain()
        writer.close()

    async def bare_kept(stream_info, reader, writer) -> None:
        """The bare stream kept open: payload after payload on one stream, one byte back for each."""
        while header := await reader.read(8):
            header += await reader.readexactly(8 - len(header))
            await reader.readexactly(int.from_bytes(header, "big"))
            writer.write(b"k")
            await writer.drain()
        writer.close()

    async def timings(stream_info, reader, writer) -> None:
        writer.write(json.dumps(sink.read_s).encode())
        await writer.drain()
        writer.close()

    dht = await SwarmDHT.create(load_identity(None))
    await serve(dht.transport, EngineRpcs, {EngineRpcs.forward: sink.forward})
    await dht.p2p.add_binary_stream_handler("bench.bare", bare)
    await dht.p2p.add_binary_stream_handler("bench.bare_kept", bare_kept)
    await dht.p2p.add_binary_stream_handler("bench.timings", timings)
    Path(ready_file).write_text(json.dumps({"maddrs": await dht.visible_maddrs(), "peer_id": dht.peer_id}))
    await asyncio.Event().wait()


async def _measure_hops(server: dict) -> dict:
    import torch
    from hivemind.p2p import PeerID

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.rpcs import EngineRpcs
    from shoal.p2p.rpc import StreamPool
    from shoal.p2p.streams import read_reply
    from shoal.protocol.pipeline import Hop
    from shoal.protocol.tensors import TensorAssembler
    from shoal.protocol.torch_tensors import frames_to_tensor, tensor_to_frames

    torch.set_num_threads(1)
    client = await SwarmDHT.create(load_identity(None), initial_peers=server["maddrs"], client_mode=True)
    peer = PeerID.from_base58(server["peer_id"])
    tensor = torch.randn(4, HOP_BYTES // 4 // 4 // 128, 128)  # (B, T, C): a 1 MiB activation
    payload = tensor.numpy().tobytes()
    request = ForwardRequest(
        microbatch_id="bench", origin=client.peer_id, step=0, hop=0, route=(Hop(stage=1, peer_id=server["peer_id"]),)
    )

    pool = StreamPool(client.transport)
    kept: list = []  # the kept bare stream, opened by its first hop

    async def shoal_hop() -> dict:
        """What PipelineEngine._send_once does, timed in its phases: a kept stream from the pool."""
        t0 = time.perf_counter()
        stream, _ = await pool.take(server["peer_id"], EngineRpcs.forward, 30)
        t1 = time.perf_counter()
        await stream.write_message(request)
        await stream.write_tensor(tensor, "float32")
        t2 = time.perf_counter()
        assert (await read_reply(stream, Ack)).accepted
        t3 = time.perf_counter()
        pool.give_back(server["peer_id"], EngineRpcs.forward, stream)
        return {"total": t3 - t0, "open": t1 - t0, "send": t2 - t1, "ack_wait": t3 - t2}

    async def timed_bare(reader, writer, t0: float) -> dict:
        t1 = time.perf_counter()
        writer.write(len(payload).to_bytes(8, "big") + payload)
        await writer.drain()
        t2 = time.perf_counter()
        await reader.readexactly(1)
        t3 = time.perf_counter()
        return {"total": t3 - t0, "open": t1 - t0, "send": t2 - t1, "ack_wait": t3 - t2}

    async def bare_hop() -> dict:
        """The target's baseline: a stream opened for the hop, its payload, one byte back."""
        t0 = time.perf_counter()
        _, reader, writer = await client.p2p.call_binary_stream_handler(peer, "bench.bare")
        try:
            return await timed_bare(reader, writer, t0)
        finally:
            writer.close()

    async def bare_kept_hop() -> dict:
        """The bare stream kept open across hops, as shoal's are."""
        t0 = time.perf_counter()
        if not kept:
            kept.extend((await client.p2p.call_binary_stream_handler(peer, "bench.bare_kept"))[1:])
        return await timed_bare(*kept, t0)

    kinds = (shoal_hop, bare_hop, bare_kept_hop)
    times: dict = {kind: [] for kind in kinds}
    try:
        for i in range(HOP_REPEATS + HOP_WARMUP):
            for kind in kinds[i % 3 :] + kinds[: i % 3]:  # rotate which goes first
                measured = await kind()
                if i >= HOP_WARMUP:
                    times[kind].append(measured)
        _, reader, writer = await client.p2p.call_binary_stream_handler(peer, "bench.timings")
        server_read_s = json.loads(await reader.read())[HOP_WARMUP:]
        writer.close()
    finally:
        pool.close()
        if kept:
            kept[1].close()
        await client.shutdown()
    shoal_t, bare_t, bare_kept_t = times[shoal_hop], times[bare_hop], times[bare_kept_hop]
    serialize_s, decode_s = [], []  # the codec alone, without the stream: each end's own work on a hop
    for _ in range(HOP_REPEATS):
        started = time.perf_counter()
        header, chunks = tensor_to_frames(tensor, "float32")
        serialize_s.append(time.perf_counter() - started)
        received = [bytes(chunk) for chunk in chunks]  # fresh bytes, as a stream reader hands them over
        started = time.perf_counter()
        assembler = TensorAssembler(Sink.spec)
        assembler.begin(header)
        for chunk in received:
            assembler.add(chunk)
        frames_to_tensor(header.meta, assembler.finish(), Sink.spec)
        decode_s.append(time.perf_counter() - started)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)

    def p90(values: list[float]) -> float:
        return round(sorted(values)[int(0.9 * len(values))] * 1e3, 2)

    shoal_total, bare_total = [t["total"] for t in shoal_t], [t["total"] for t in bare_t]
    bare_kept_total = [t["total"] for t in bare_kept_t]
    paired = [s / b for s, b in zip(shoal_total, bare_total, strict=True)]
    return {
        "bytes": HOP_BYTES,
        "repeats": HOP_REPEATS,
        "shoal_rpc_median_ms": ms(shoal_total),
        "bare_stream_median_ms": ms(bare_total),
        "shoal_over_bare": round(statistics.median(shoal_total) / statistics.median(bare_total), 3),
        "paired_ratio_median": round(statistics.median(paired), 3),
        "paired_ratio_range": [round(min(paired), 3), round(max(paired), 3)],
        "shoal_rpc_p90_ms": p90(shoal_total),
        "bare_stream_p90_ms": p90(bare_total),
        "shoal_phases_median_ms": {k: ms([t[k] for t in shoal_t]) for k in ("open", "send", "ack_wait")},
        "bare_phases_median_ms": {k: ms([t[k] for t in bare_t]) for k in ("open", "send", "ack_wait")},
        "shoal_stream": "kept (StreamPool, as PipelineEngine._send_once); the bare stream is opened per hop",
        "bare_kept_stream_median_ms": ms(bare_kept_total),
        "shoal_over_bare_kept": round(
            statistics.median(shoal_total) / statistics.median(t["total"] for t in bare_kept_t), 3
        ),
        "sender_serialize_median_ms": ms(serialize_s),
        "receiver_decode_and_check_median_ms": ms(decode_s),
        "receiver_read_median_ms": ms(server_read_s),  # from the request to the tensor: waits for its bytes
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


# ---- comparison and report ------------------------------------------------------------------------


def side_rates(run: dict, warmup: int) -> dict:
    tokens = run.get("step_tokens") or [run.get("tokens_per_step")] * len(run["step_s"])
    steps = [{"tokens": t, "seconds": s} for t, s in zip(tokens, run["step_s"], strict=True)]
    return {"whole_run": tokens_per_s(steps), "steady_state": tokens_per_s(steps, warmup)}


def loss_parity(swarm: dict, local: dict) -> dict:
    pairs = [(s, loc) for s, loc in zip(swarm["losses"], local["losses"], strict=True) if s is not None]
    gaps = [abs(s - loc) for s, loc in pairs]
    return {
        "steps_compared": len(pairs),
        "first_step_over_tolerance": next((i for i, gap in enumerate(gaps) if gap > PARITY_TOLERANCE), None),
        "max_abs_diff": max(gaps),
        "mean_abs_diff": statistics.mean(gaps),
        "final_loss_swarm": swarm["final_loss"],
        "final_loss_local": local["final_loss"],
        "final_abs_diff": abs(swarm["final_loss"] - local["final_loss"]),
    }


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def abandoned_text(a: dict) -> str:
    if a["count"] == 0:
        return (
            f"none: all {a['microbatches']:,} microbatches of the {a['runs']} swarm runs (memory run included) "
            f"completed; {a['resent']} forward passes were sent again."
        )
    reasons = "; ".join(f"{n} × “{r}”" for r, n in a["reasons"].items())
    lost = f"{a['count']} of {a['microbatches']:,} microbatches abandoned"
    return f"**{lost}: the benchmark fails.** Reasons: {reasons}."


def budget_lines(r: dict, target: float) -> list[str]:
    """Where the swarm's CPU budget went, by thread kind, and what the target asks of its compute."""
    splits = [x["cpu_split"] for x in r["swarm_runs"] if "cpu_split" in x]
    if not splits:  # results from before the split was measured
        return []
    share = {kind: statistics.median(split[kind] for split in splits) for kind in splits[0]}
    k = r["cpu_budget"]["cores"]
    # tokens per CPU second of the compute threads alone (tokens_per_cpu_s counts every process's CPU)
    per_compute_s = [
        x["tokens_per_cpu_s"] * (1 - x["cpu_split"]["idle"]) / x["cpu_split"]["compute_threads"]
        for x in r["swarm_runs"]
    ]
    local_rate = statistics.median(x["tokens_per_s"]["steady_state"] for x in r["local_runs"])
    needed = target * local_rate / (statistics.median(per_compute_s) * k)
    return [
        f"- The swarm's CPU budget ({k} cores for the run's wall time), median over repeats: the nodes' compute "
        f"threads (torch) {share['compute_threads']:.0%}, their other threads (event loop: streams, codec, DHT; "
        f"and the bootstrap peer) {share['other_threads']:.0%}, the p2pd daemons {share['p2pd']:.0%}, unused "
        f"{share['idle']:.0%} (the pipeline's fill and drain, and waits). Per CPU second of their own, the compute "
        f"threads trained {spread(per_compute_s, 0)} tokens, against the local trainer's "
        f"{spread([x['tokens_per_cpu_s'] for x in r['local_runs']], 0)} with {k} threads: {target} of the local "
        f"trainer's speed at that rate needs {needed:.0%} of the budget in the compute threads.",
    ]


def markdown(r: dict) -> str:
    hop, mem, budget = r["hop_latency"], r["memory_over_long_run"], r["cpu_budget"]
    threads = budget.get("node_threads", 1)
    steady, whole = r["ratio_vs_local_steady"], r["ratio_vs_local_whole_run"]
    parity, load = r["loss_parity"], r["load_average"]
    peak = r["swarm_runs"][0]["peak_rss_mb"]
    k = budget["cores"]
    local_rate = [x["tokens_per_s"] for x in r["local_runs"]]
    swarm_rate = [x["tokens_per_s"] for x in r["swarm_runs"]]
    target = r["target_ratio"]
    verdict = "meets" if statistics.median(steady) >= target else "misses"
    local_share_min = min(x["cpu_share"] for x in r["local_runs"])
    averaging = r.get("averaging") or asdict(load_run_config(r["run"]).averaging)  # older results: the run's own
    swarm_losses, local_losses = r["losses"]["swarm"], r["losses"]["local"]  # the first repeat's
    gaps = [None if a is None else abs(a - b) for a, b in zip(swarm_losses, local_losses, strict=True)]
    departs = next((i for i, gap in enumerate(gaps) if gap is not None and gap > PARITY_TOLERANCE), None)
    cpu_local = statistics.median(x["cpu_share"] for x in r["local_runs"])
    cpu_swarm = statistics.median(x["cpu_share"] for x in r["swarm_runs"])
    by_process = r["swarm_runs"][0]["cpu_s_by_process"]
    swarm_wall = r["swarm_runs"][0]["wall_s"]
    phases = hop["shoal_phases_median_ms"]
    bare_phases = hop["bare_phases_median_ms"]
    extra = {p: phases[p] - bare_phases[p] for p in phases}
    worst = max(extra, key=extra.get)
    gap = hop["shoal_rpc_median_ms"] - hop["bare_stream_median_ms"]
    codec = hop["sender_serialize_median_ms"] + hop["receiver_decode_and_check_median_ms"]
    lines = [
        "# Pipeline efficiency: the swarm against the single-process trainer"
        + ("" if r["run"] == "tiny" else f" (run `{r['run']}`)")
        + ("" if r.get("wire_dtype", "float32") == "float32" else f", {r['wire_dtype']} on the wire"),
        "",
        f"Reproduce: `{r['command']}` ({wall_time(r['wall_s'])} here). Run `{r['run']}` "
        f"({r['params']:,} parameters, {r['stages']} stages, batch {r['batch']} sequences of {r['seq_len']} tokens in "
        f"{r['microbatches_per_step']} microbatches, {r.get('wire_dtype', 'float32')} on the wire). "
        f"Both sides train the same {r['steps_local']} steps on the same batches, {r['repeats']} alternating repeats; "
        "median (min–max). "
        f"Whole run: every step, warm-up included (start-up and the final evaluation left out on both sides); "
        f"steady state: without the first {r['warmup_steps']} steps.",
        "",
        f"**Same CPU budget**: everything runs confined to the same {k} core{'s' if k > 1 else ''} "
        f"({budget['core_ids']}; asserted for every process, p2pd daemons included): the local trainer with "
        f"{k} torch thread{'s' if k > 1 else ''} in one process, the swarm as a bootstrap peer, "
        f"{r['stages'] - 1} stage workers and 1 data node with {threads} torch "
        f"thread{'s' if threads > 1 else ''} each.",
        "",
        "| side | tokens/s, steady state | tokens/s, whole run | CPU time used of its budget | tokens per CPU second |",
        "|---|---|---|---|---|",
        f"| local trainer, {k} thread{'s' if k > 1 else ''} | "
        f"{spread([x['steady_state'] for x in local_rate], 0)} | {spread([x['whole_run'] for x in local_rate], 0)} "
        f"| {cpu_local:.0%} | {spread([x['tokens_per_cpu_s'] for x in r['local_runs']], 0)} |",
        f"| swarm | {spread([x['steady_state'] for x in swarm_rate], 0)} "
        f"| {spread([x['whole_run'] for x in swarm_rate], 0)} | {cpu_swarm:.0%} "
        f"| {spread([x['tokens_per_cpu_s'] for x in r['swarm_runs']], 0)} |",
        f"| swarm ÷ local (paired by repeat) | {spread(steady)} | {spread(whole)} | | |",
        "",
        f"Load average before the run: {load['before'][0]:.1f} on {r['machine']['cpus']} CPUs (after it: "
        f"{load['after'][0]:.1f}, this benchmark's own processes included)"
        + (
            ": other processes were already competing for these cores, so neither side had its whole budget "
            "(the CPU column says how much each got)."
            if load["before"][0] > 0.5 * k
            else "."
        ),
        "",
        (
            f"Target: the swarm at ≥ {target} of the local trainer at equal steps and CPU budget. This run "
            f"{verdict} it: **{statistics.median(steady):.3f}** in steady state, {statistics.median(whole):.3f} "
            "over the whole run."
            if local_share_min >= MIN_LOCAL_CPU_SHARE
            else f"**No verdict from this run**: the local trainer, CPU-bound by construction, got as little as "
            f"{local_share_min:.0%} of its {k} cores while it ran (at least {MIN_LOCAL_CPU_SHARE:.0%} needed): other "
            f"processes were using them, so the ratio ({statistics.median(steady):.2f}) measures the machine's load, "
            "not shoal. Rerun it on a quiet machine."
        ),
        "",
        f"- Abandoned microbatches: {abandoned_text(r['abandoned'])}",
        f"- Loss parity at equal steps: the swarm's per-step loss is within {parity['max_abs_diff']:.2g} of the "
        f"local trainer's over {parity['steps_compared']} steps (mean gap {parity['mean_abs_diff']:.2g}); "
        f"final loss {parity['final_loss_swarm']:.4f} against {parity['final_loss_local']:.4f} "
        f"(first repeat; the largest gap of any repeat is {r['loss_parity_max_abs_diff_any_repeat']:.2g}). "
        + (
            f"The losses agree within {PARITY_TOLERANCE:g} at every step."
            if departs is None
            else f"They agree within {PARITY_TOLERANCE:g} up to step {departs}, where they part"
            + (
                f": the swarm averaged with {averaging['mode']} every {averaging['inner_steps']} steps (with one "
                "replica per stage, an outer step alone), which the local trainer does not do."
                if averaging["mode"] != "none" and departs % averaging["inner_steps"] == 0
                else "."
            )
        ),
        f"- Where the swarm's CPU went (first repeat, {swarm_wall:.0f} s of training, CPU seconds): "
        + ", ".join(f"{name} {s:.1f}" for name, s in sorted(by_process.items(), key=lambda kv: -kv[1]))
        + f". The busiest process used {max(by_process.values()) / swarm_wall:.0%} of one core.",
        *budget_lines(r, target),
        f"- Bytes on the wire per microbatch (all hops, forward and backward): "
        f"{r['swarm_runs'][0]['wire_bytes_per_microbatch'] / 2**20:.2f} MiB "
        f"(one activation is {r['activation_bytes'] / 2**10:.0f} KiB).",
        f"- A 1 MiB hop, median of {hop['repeats']} alternating pairs: shoal's forward RPC "
        f"{hop['shoal_rpc_median_ms']:.2f} ms (p90 {hop['shoal_rpc_p90_ms']}), a bare hivemind stream "
        f"{hop['bare_stream_median_ms']:.2f} ms (p90 {hop['bare_stream_p90_ms']}) between the same two processes: "
        f"**×{hop['shoal_over_bare']:.2f}** (per pair: {hop['paired_ratio_median']:.2f}, "
        f"{hop['paired_ratio_range'][0]:.2f}–{hop['paired_ratio_range'][1]:.2f}). "
        f"Shoal's hop: open {phases['open']:.2f} ms, send {phases['send']:.2f} ms, wait for the ack "
        f"{phases['ack_wait']:.2f} ms (bare: {bare_phases['open']:.2f}, {bare_phases['send']:.2f}, "
        f"{bare_phases['ack_wait']:.2f}); the most extra time is in the {worst.replace('_', ' ')} "
        f"(+{extra[worst]:.2f} ms). "
        + (f"Of the {gap:.2f} ms shoal adds to the bare stream, " if gap > 0 else "")
        + f"{'t' if gap > 0 else 'T'}he codec's own work is {codec:.2f} ms (the sender's serialization "
        f"{hop['sender_serialize_median_ms']:.2f} ms, the receiver's assembly and checks "
        f"{hop['receiver_decode_and_check_median_ms']:.2f} ms, measured apart). "
        f"Target: ≤ {HOP_TARGET} × the bare stream; "
        f"{'met' if hop['shoal_over_bare'] <= HOP_TARGET else 'missed'}."
        + (
            f" Shoal's hops keep their stream (one per pair of peers and direction, reused while the receiver "
            f"accepts), so its open is a pool lookup, where the bare stream of the target opens one per hop. "
            f"Against a bare stream also kept open ({hop['bare_kept_stream_median_ms']:.2f} ms), shoal's hop is "
            f"×{hop['shoal_over_bare_kept']:.2f}: that is its own framing, checks and acknowledgement."
            if "bare_kept_stream_median_ms" in hop
            else ""
        ),
        "- Peak resident memory per process (MiB): " + ", ".join(f"{n} {mb}" for n, mb in peak.items()) + ".",
        f"- Memory over a long run of {mem['steps']} steps ({mem['microbatches']:,} microbatches, "
        f"{mem['abandoned']} abandoned): "
        + "; ".join(
            f"{k} {v['early_mb']} → {v['late_mb']} MiB ({v['growth_mb']:+.1f})" for k, v in mem["nodes"].items()
        )
        + ".",
    ]
    return "\n".join(lines)


def pin(cores_wanted: int | None) -> set[int]:
    available = sorted(os.sched_getaffinity(0))
    n = cores_wanted or len(available)
    if not 1 <= n <= len(available):
        raise SystemExit(f"--cores {n}: this process may use {len(available)} cores ({available})")
    cores = set(available[:n])
    os.sched_setaffinity(0, cores)  # inherited by every process started from here on
    return cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="tiny")
    parser.add_argument("--steps", type=int, default=100, help="steps of every measurement, both sides")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=10, help="left out of the steady state")
    parser.add_argument("--cores", type=int, default=None, help="the CPU budget of each side (default: all)")
    parser.add_argument("--long-steps", type=int, default=250, help="steps of the memory run (x microbatches)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--node-threads", type=int, default=1, help="torch threads of each swarm node")
    parser.add_argument(
        "--wire-dtype",
        default=None,
        choices=WIRE_DTYPES,
        help="activations and gradients between peers (default: the run's); the local trainer rounds to it at "
        "every hop as the peers do",
    )
    parser.add_argument(
        "--averaging",
        default="none",
        choices=("none", "noloco", "diloco"),
        help="the swarm's averaging (default none: the local trainer does no outer steps, and with one replica "
        "per stage there is nobody to average with)",
    )
    parser.add_argument("--render-only", action="store_true", help="rewrite the docs section from --results")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page whose `pipeline` section is rewritten")
    parser.add_argument("--section", default="pipeline", help="the section of --doc to rewrite")
    parser.add_argument("--hops-only", action="store_true", help="measure the 1 MiB hop only; print it, write nothing")
    parser.add_argument("--serve-hop", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_hop:
        asyncio.run(_serve_hop(args.serve_hop))
        return 0
    if args.local_worker:
        local_worker(args.local_worker[0], int(args.local_worker[1]), args.local_worker[2])
        return 0
    if args.render_only:
        print(f"wrote {write_section(args.section, markdown(json.loads(args.results.read_text())), args.doc)}")
        return 0
    if args.hops_only:
        with tempfile.TemporaryDirectory(prefix="shoal-hops-") as tmp:
            print(json.dumps(hop_latency(Path(tmp)), indent=1))
        return 0
    assert 0 <= args.warmup_steps < args.steps, "--warmup-steps must leave steps to measure"
    started = time.monotonic()
    load_before = os.getloadavg()
    cores = pin(args.cores)
    run = load_run_config(args.run)
    from shoal.model.corpus import default_corpus_path

    run = run.replace(
        {
            "data.path": run.data.path or str(default_corpus_path()),
            "train.steps": args.steps,
            "averaging.mode": args.averaging,
            "pipeline.wire_dtype": args.wire_dtype or run.pipeline.wire_dtype,
            # top-k outer exchanges are NoLoCo's: DiLoCo's all-reduce sends int8, no averaging sends nothing
            **(
                {"averaging.codec": "int8" if args.averaging == "diloco" else "float32"}
                if args.averaging != "noloco" and run.averaging.codec == "topk"
                else {}
            ),
        }
    )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        workdir = Path(tmp)
        run_file = workdir / "run.toml"
        run_file.write_text(run.to_toml())
        locals_, swarms = [], []
        for repeat in range(args.repeats):
            order = ("local", "swarm") if repeat % 2 == 0 else ("swarm", "local")
            for side in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {side} ...", file=sys.stderr)
                if side == "local":
                    locals_.append(local_run(run_file, cores, workdir))
                else:
                    swarms.append(swarm_run(run_file, args.steps, cores, workdir, args.node_threads))
        print("hop latency ...", file=sys.stderr)
        hops = hop_latency(workdir)
        print(f"memory run: {args.long_steps} steps ...", file=sys.stderr)
        long_file = workdir / "long.toml"
        long_file.write_text(run.replace({"train.steps": args.long_steps}).to_toml())
        long_run = swarm_run(long_file, args.long_steps, cores, workdir, args.node_threads)

    steps_local = {x["steps"] for x in locals_}
    steps_swarm = {x["steps"] for x in swarms}
    assert steps_local == steps_swarm == {args.steps}, f"unequal steps: local {steps_local}, swarm {steps_swarm}"
    for side in (*locals_, *swarms):
        side["tokens_per_s"] = side_rates(side, args.warmup_steps)
        side["tokens_per_cpu_s"] = args.steps * locals_[0]["tokens_per_step"] / side["cpu_s"]
    ratio = {
        kind: [s["tokens_per_s"][kind] / loc["tokens_per_s"][kind] for s, loc in zip(swarms, locals_, strict=True)]
        for kind in ("steady_state", "whole_run")
    }
    parities = [loss_parity(s, loc) for s, loc in zip(swarms, locals_, strict=True)]
    everything = [*swarms, long_run]
    reasons: Counter = Counter()
    for s in everything:
        reasons.update(s["abandoned_reasons"])
    abandoned = {
        "count": sum(s["abandoned"] for s in everything),
        "reasons": dict(reasons),
        "by_run": [s["abandoned"] for s in everything],
        "microbatches": sum(s["microbatches"] for s in everything),
        "in_flight_at_end": sum(s["in_flight_at_end"] for s in everything),
        "resent": sum(s["resent"] for s in everything),
        "runs": len(everything),
    }
    params = run.model.params()
    command = "python benchmarks/pipeline_efficiency.py" + "".join(
        f" --{name.replace('_', '-')} {getattr(args, name)}"
        for name in (
            "run",
            "steps",
            "repeats",
            "warmup_steps",
            "cores",
            "long_steps",
            "target",
            "averaging",
            "section",
            "node_threads",
            "wire_dtype",
        )
        if getattr(args, name) != parser.get_default(name)
    )
    result = {
        "command": command,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "run": run.name,
        "params": params,
        "stages": run.pipeline.stages,
        "batch": run.train.batch_size,
        "seq_len": run.train.seq_len,
        "microbatches_per_step": run.microbatches_per_step,
        "wire_dtype": run.pipeline.wire_dtype,
        "steps_local": steps_local.pop(),
        "steps_swarm": steps_swarm.pop(),
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "cpu_budget": {
            "cores": len(cores),
            "core_ids": sorted(cores),
            "local": f"1 process x {len(cores)} torch threads",
            "swarm": f"{run.pipeline.stages + 1} processes (bootstrap, {run.pipeline.stages - 1} workers, data) "
            f"x {args.node_threads} torch thread(s), and their p2pd daemons",
            "node_threads": args.node_threads,
            "meaning": "both sides confined to the same cores by CPU affinity, asserted for every process",
        },
        "target_ratio": args.target,
        "averaging": asdict(run.averaging),
        "ratio_vs_local": statistics.median(ratio["steady_state"]),
        "ratio_vs_local_steady": ratio["steady_state"],
        "ratio_vs_local_whole_run": ratio["whole_run"],
        "hop_over_bare_stream": hops["shoal_over_bare"],
        "abandoned": abandoned,
        "loss_parity": parities[0],
        "loss_parity_max_abs_diff_any_repeat": max(p["max_abs_diff"] for p in parities),
        "activation_bytes": run.train.microbatch_size * run.train.seq_len * run.model.d_model * 4,
        "local_runs": [{k: v for k, v in x.items() if k not in ("losses", "step_s")} for x in locals_],
        "swarm_runs": [
            {k: v for k, v in s.items() if k not in ("rss_samples", "losses", "step_s", "step_tokens")} for s in swarms
        ],
        "losses": {"local": locals_[0]["losses"], "swarm": swarms[0]["losses"]},
        "hop_latency": hops,
        "memory_over_long_run": {
            "steps": args.long_steps,
            "microbatches": long_run["microbatches"],
            "abandoned": long_run["abandoned"],
            "abandoned_reasons": long_run["abandoned_reasons"],
            "resent": long_run["resent"],
            "nodes": {name: memory_growth(samples) for name, samples in long_run["rss_samples"].items()},
            "peak_rss_mb": long_run["peak_rss_mb"],
            "tokens_per_s": side_rates(long_run, args.warmup_steps),
        },
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "wall_s": time.monotonic() - started,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    doc = write_section(args.section, markdown(result), args.doc)
    summary = ("ratio_vs_local", "ratio_vs_local_whole_run", "hop_over_bare_stream", "abandoned")
    print(json.dumps({k: result[k] for k in summary}, indent=2))
    print(f"wrote {args.results} and {doc}", file=sys.stderr)
    failed = 0
    if min(x["cpu_share"] for x in locals_) < MIN_LOCAL_CPU_SHARE:
        print("NOT COMPARABLE: the local trainer did not get its cores (another load): rerun on a quiet machine",
              file=sys.stderr)  # fmt: skip
        failed = 1
    if abandoned["count"] or abandoned["in_flight_at_end"]:
        print(
            f"FAILED: the swarm lost {abandoned['count']} microbatch(es) ({abandoned['in_flight_at_end']} still in "
            f"flight at the end) on loopback without faults; reasons: {dict(reasons)}",
            file=sys.stderr,
        )
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
