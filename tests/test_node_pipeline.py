"""Pipeline training across real daemons: step-for-step parity with the single-process trainer,
and stage workers that refuse bad tensors and keep serving."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import torch

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.pipeline.hops import step_close_patience_s
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import Rpc, StreamPool
from shoal.p2p.streams import FramedStream, RemoteError, read_reply
from shoal.protocol.pipeline import Ack, BackwardRequest, ForwardRequest, Hop
from shoal.protocol.tensors import TensorHeader, TensorMeta
from shoal.run_files import load_run_config
from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]
PARITY_RUN = {"train.steps": 8, "averaging.mode": "none", "train.eval_every": 3}


@pytest.fixture
def run_file(tmp_path):
    return write_tiny_run(tmp_path, **PARITY_RUN)


def test_swarm_loss_matches_the_local_trainer_step_for_step(swarm, run_file, tmp_path):
    """Real daemons train the losses the local trainer does, step for step, with the evaluations and
    every microbatch accounted for. The same with closes overtaken by the next step's forwards, over a
    bfloat16 or int8 wire, under bf16 autocast and in a Subspace Network's run is checked in one process
    (tests/test_node_inprocess.py); here, what only real peers show: libp2p streams kept across steps,
    one compute thread a process, the stats and traces each daemon writes."""
    run = load_run_config(str(run_file))
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = [tmp_path / f"worker{i}.json" for i in range(run.pipeline.stages - 1)]
    traces = [path.with_suffix(".trace") for path in stats]
    workers = [
        swarm.start_node([entry], "--role", "worker", "--stats-file", str(s), "--compute-trace", str(t), wait=False)
        for s, t in zip(stats, traces, strict=True)
    ]
    for worker in workers:
        swarm.wait_ready(worker)
    assert sorted(w.stage for w in workers) == list(range(1, run.pipeline.stages))
    progress, data_stats = tmp_path / "progress.jsonl", tmp_path / "data.json"
    data = swarm.start_node([entry], "--role", "data", "--progress-file", str(progress),
                            "--stats-file", str(data_stats))  # fmt: skip
    done = wait_until(lambda: done_event(progress), 240, "the data node to finish training")

    splits = load_token_splits(run.data, run.model.vocab_size)
    reference = ReferenceTrainer(run, splits).train()
    swarm_losses = [e["loss"] for e in progress_events(progress) if e["event"] == "step"]
    local_losses = [r.loss for r in reference.history]
    assert len(swarm_losses) == len(local_losses) == run.train.steps
    # only the order of float operations differs (hop-by-hop graphs, threads; under autocast, bf16's
    # rounding of those differently ordered sums)
    tolerance = 2e-4
    assert swarm_losses == pytest.approx(local_losses, rel=tolerance, abs=tolerance)
    assert done["val_loss"] == pytest.approx(reference.val_loss, rel=tolerance)
    steps = [e for e in progress_events(progress) if e["event"] == "step"]
    swarm_val = {e["step"]: e["val_loss"] for e in steps if "val_loss" in e}
    local_val = {r.step: r.val_loss for r in reference.history if r.val_loss is not None}
    assert set(swarm_val) == set(local_val) == {2, 5}  # train.eval_every 3; after step 7 it is done's val_loss
    assert list(swarm_val.values()) == pytest.approx(list(local_val.values()), rel=tolerance)
    assert done["microbatches_completed"] + done["microbatches_abandoned"] == done["microbatches_injected"]
    assert done["microbatches_abandoned"] == 0
    assert swarm_losses[-1] < swarm_losses[0]

    # each worker's step closes came on one kept stream (a close sent again is answered, never handled
    # twice), and each worker stepped once per step
    assert swarm.stop(data) == 0
    for worker in workers:
        assert swarm.stop(worker) == 0
    engine = json.loads(data_stats.read_text())["engine"]
    assert engine["kept_streams_dead"] == 0
    assert engine["streams_opened_by_rpc"][EngineRpcs.step_close.name] == len(workers)
    assert [json.loads(path.read_text())["engine"]["inner_steps"] for path in stats] == [run.train.steps] * len(workers)
    for trace in traces:  # every compute job traced: start, end, job, CPU seconds
        jobs = Counter(line.split()[2] for line in trace.read_text().splitlines())
        assert jobs["step"] == run.train.steps and jobs["_run_backward"] == run.train.steps * run.microbatches_per_step


def test_a_close_stuck_in_a_worker_holds_the_next_steps_forwards_no_longer_than_the_data_nodes_patience(
    swarm, tmp_path
):
    """A worker holds a step's forwards until it has handled the step close before. If that handling
    hangs (an outer step stuck in its all-reduce did, for good), the data node gives up on the answer
    after its patience, and so must the worker: its held forwards go ahead, and nothing is lost. When
    the stuck close ends, later closes have been handled: it is stale and must not step again."""
    exchange_timeout_s, stall_s, steps = 0.5, 22.0, 80
    patience_s = step_close_patience_s(exchange_timeout_s)
    run_file = write_tiny_run(
        tmp_path,
        **{"train.steps": steps, "averaging.mode": "none", "averaging.exchange_timeout_s": exchange_timeout_s},
    )
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stuck = swarm.start_node([entry], "--role", "worker", "--stage", "1", "--inject-close-stall", f"2:{stall_s}")
    swarm.start_node([entry], "--role", "worker", "--stage", "2")
    progress = tmp_path / "progress.jsonl"
    # closes 0.2 s late: each step waits for its close, so the stuck close ends while training goes on
    data = swarm.start_node([entry], "--role", "data", "--progress-file", str(progress), "--inject-close-delay", "0.2")
    done = wait_until(lambda: done_event(progress), 240, "the data node to finish training")

    step_s = {e["step"]: e["step_s"] for e in progress_events(progress) if e["event"] == "step"}
    assert sorted(step_s) == list(range(steps))
    assert patience_s - 3 < step_s[3] < patience_s + 5 < stall_s - 5, step_s  # held, then let go at the patience
    assert "the close of step 2 is still being handled" in stuck.log()
    assert "step 2 close not taken" in data.log()
    assert "the close of step 2 comes after that of step" in stuck.log()  # it ended mid-run, and stepped nothing
    assert done["microbatches_completed"] == done["microbatches_injected"]
    assert done["microbatches_abandoned"] == 0


def _bad_cases(run) -> dict[str, tuple[TensorHeader, list[bytes]]]:
    b, t, d = run.train.microbatch_size, run.train.seq_len, run.model.d_model
    good = torch.zeros(b, t, d)
    nan = good.clone()
    nan[0, 0, 0] = float("nan")

    def frames(x: torch.Tensor, dtype: str = "float32") -> tuple[TensorHeader, list[bytes]]:
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        meta = TensorMeta(dtype=dtype, shape=tuple(x.shape))
        chunk = 2 * 1024 * 1024
        pieces = [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
        return TensorHeader(meta=meta, nbytes=len(raw), num_chunks=len(pieces)), pieces

    wrong_dtype = frames(good.to(torch.float16).view(torch.int16).to(torch.int32), "int32")
    oversized_shape = (b, run.model.max_seq_len * 64, d)
    oversized = (
        TensorHeader(
            meta=TensorMeta("float32", oversized_shape), num_chunks=64, nbytes=b * run.model.max_seq_len * 64 * d * 4
        ),
        [b"\0" * 16],
    )
    return {
        "nan": frames(nan),
        "wrong dtype": wrong_dtype,
        "wrong shape": frames(torch.zeros(b, t, d + 1)),
        "oversized": oversized,
        "too long": frames(torch.zeros(b, run.model.max_seq_len + 1, d)),
    }


def test_stage_worker_refuses_bad_tensors_and_keeps_serving(swarm, run_file):
    run = load_run_config(str(run_file))
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    worker = swarm.start_node([entry], "--role", "worker")

    async def send(header: TensorHeader, chunks: list[bytes], backward: bool = False, microbatch: str = "probe") -> str:
        client = await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)
        try:
            route = (Hop(stage=worker.stage, peer_id=worker.peer_id),)
            fields = dict(microbatch_id=microbatch, origin=client.peer_id, step=0, route=route)
            request = BackwardRequest(hop=0, **fields) if backward else ForwardRequest(hop=0, **fields)
            stream = await client.transport.open(
                worker.peer_id, (EngineRpcs.backward if backward else EngineRpcs.forward).protocol, 10
            )
            try:
                await stream.write_message(request)
                await stream.write_message(header)
                for chunk in chunks:
                    await stream.write_frame(chunk)
                ack = await read_reply(stream, Ack)
                return "accepted" if ack.accepted else f"declined: {ack.reason}"
            except RemoteError as e:
                return e.code
            finally:
                stream.close()
        finally:
            await client.shutdown()

    for name, (header, chunks) in _bad_cases(run).items():
        assert asyncio.run(send(header, chunks)) == "bad_tensor", name
    # a well-formed activation is still taken (then fails onward: the probe is no data node)
    b, t, d = run.train.microbatch_size, run.train.seq_len, run.model.d_model
    raw = torch.randn(b, t, d).numpy().tobytes()
    header = TensorHeader(meta=TensorMeta("float32", (b, t, d)), nbytes=len(raw), num_chunks=1)
    assert asyncio.run(send(header, [raw])) == "accepted"
    # a gradient for a microbatch the worker never saw is declined, not crashed on
    assert asyncio.run(send(header, [raw], backward=True, microbatch="never-seen")).startswith("declined")
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()


def test_hops_share_one_kept_stream_and_the_worker_closes_it_after_anything_but_an_accept(swarm, run_file):
    """The pipeline's hops reuse a stream per (peer, rpc) (`StreamPool`): the worker reads request after
    request on it while it accepts them, and closes it after a refusal or an error reply, so that a
    stream with unread bytes is never reused."""
    run = load_run_config(str(run_file))
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    worker = swarm.start_node([entry], "--role", "worker")
    b, t, d = run.train.microbatch_size, run.train.seq_len, run.model.d_model

    async def scenario() -> None:
        client = await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)
        pool = StreamPool(client.transport)
        route = (Hop(stage=worker.stage, peer_id=worker.peer_id),)

        async def hop(rpc: Rpc, microbatch: str, tensor: torch.Tensor) -> tuple[FramedStream, bool, object]:
            stream, kept = await pool.take(worker.peer_id, rpc, 10)
            fields = dict(microbatch_id=microbatch, origin=client.peer_id, step=0, hop=0, route=route)
            request = BackwardRequest(**fields) if rpc == EngineRpcs.backward else ForwardRequest(**fields)
            await stream.write_message(request)
            await stream.write_tensor(tensor, "float32")
            try:
                return stream, kept, await read_reply(stream, Ack)
            except RemoteError as e:
                return stream, kept, e

        async def closed_by_worker(stream: FramedStream) -> bool:
            return await asyncio.wait_for(stream.reader.read(), 10) == b""

        try:
            kept_flags = []
            for i in range(3):
                stream, kept, ack = await hop(EngineRpcs.forward, f"mb{i}", torch.randn(b, t, d))
                assert isinstance(ack, Ack) and ack.accepted, ack
                kept_flags.append(kept)
                pool.give_back(worker.peer_id, EngineRpcs.forward, stream)
            assert kept_flags == [False, True, True] and (pool.opened, pool.reused) == (1, 2)

            stream, kept, reply = await hop(EngineRpcs.forward, "bad", torch.zeros(b, t, d + 1))  # the wrong shape
            assert kept and isinstance(reply, RemoteError) and reply.code == "bad_tensor", reply
            assert await closed_by_worker(stream)

            stream, kept, ack = await hop(EngineRpcs.backward, "never-seen", torch.randn(b, t, d))
            assert not kept and isinstance(ack, Ack) and not ack.accepted, ack
            assert await closed_by_worker(stream)
        finally:
            pool.close()
            await client.shutdown()

    asyncio.run(scenario())
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()
