"""A worker against peers that send it hand-built pipeline requests: repeats, floods, foreign ids and
senders, huge gradients, hostile strings. Each is refused or taken as already done, and the worker
keeps training."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import torch

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import serve
from shoal.p2p.streams import FramedStream, RemoteError
from shoal.protocol.pipeline import AbandonNotice, Ack, BackwardRequest, ForwardRequest, Hop, StepClose
from shoal.protocol.version import PROTOCOL_VERSION
from shoal.run_files import load_run_config
from tests.helpers.raw_frames import announce_data_node, send_raw_frame, send_with_tensor
from tests.helpers.tiny import tiny_run, write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

MODEL = tiny_run().model


class Home:
    """What a data node serves for activations coming home: take them, keep nothing."""

    def __init__(self) -> None:
        self.arrived = 0

    async def forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        from shoal.protocol.tensors import TensorSpec

        await stream.read_tensor(TensorSpec("float32", (None, None, MODEL.d_model)))
        self.arrived += 1
        return Ack(accepted=True)


async def client(worker) -> SwarmDHT:
    return await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)


def forward(dht: SwarmDHT, worker, mb: str, needs_backward: bool = True, origin: str | None = None) -> ForwardRequest:
    route = (Hop(stage=1, peer_id=worker.peer_id),)
    return ForwardRequest(microbatch_id=mb, origin=origin or dht.peer_id, step=0, hop=0, route=route,
                          needs_backward=needs_backward)  # fmt: skip


def backward(worker, mb: str, origin: str) -> BackwardRequest:
    return BackwardRequest(
        microbatch_id=mb, origin=origin, step=0, hop=0, route=(Hop(stage=1, peer_id=worker.peer_id),)
    )


def start_worker(swarm, tmp_path, *extra: str):
    bootstrap = swarm.start_bootstrap("--run-config", str(write_tiny_run(tmp_path)))
    stats = tmp_path / "worker.json"
    worker = swarm.start_node(
        [bootstrap.maddrs[0]], "--role", "worker", "--stage", "1", "--stats-file", str(stats), *extra
    )
    return bootstrap, worker, stats


def test_a_repeated_evaluation_forward_runs_once(swarm, tmp_path):
    """A sender whose ack was lost sends the same microbatch again: the worker answers "taken" and
    does not run (and pass on) the forward a second time, even once the first is long done."""
    _, worker, stats = start_worker(swarm, tmp_path)

    async def scenario():
        dht = await client(worker)
        try:
            request, x = forward(dht, worker, "evaluation-repeat", needs_backward=False), torch.randn(2, 8, 32)
            first = await send_with_tensor(dht, worker.peer_id, EngineRpcs.forward, request, x)
            await asyncio.sleep(2.0)  # the first forward is done and its output sent on (or given up)
            return first, await send_with_tensor(dht, worker.peer_id, EngineRpcs.forward, request, x)
        finally:
            await dht.shutdown()

    first, second = asyncio.run(scenario())
    assert first.accepted and second.accepted
    assert swarm.stop(worker) == 0
    assert json.loads(stats.read_text())["engine"]["forwards"] == 1


def test_gradients_are_taken_only_from_the_next_hop_bounded_and_a_step_still_comes(swarm, tmp_path):
    """The breaks a hostile peer found: huge finite gradients made the weights NaN and the node leave
    the swarm; a duplicate microbatch id stopped its optimizer for good; a backward could name another
    origin; a step close for step 2^63-1 from any peer that had sent one training microbatch made the
    inner step 2^63, which no record can carry, and the worker left the swarm (issue 58). Now: huge
    values are refused at the wire, the id is taken once, only the hop after ours (here the data node
    that sent it) may send the gradient or abandon the microbatch, a step is closed only by a data node
    the worker's view lists and only within the steps it can vouch for, and the worker steps once that
    data node closes its step. Heartbeats every 2 s (--record-ttl 6): a record the worker cannot
    publish shows within the test."""
    bootstrap, worker, stats = start_worker(swarm, tmp_path, "--record-ttl", "6")
    run = load_run_config(tmp_path / "run.toml")

    async def scenario():
        origin, stranger, home = await client(worker), await client(worker), Home()
        await serve(origin.transport, EngineRpcs, {EngineRpcs.forward: home.forward})
        await announce_data_node(origin, run.run_id)  # a data node of the run, as far as the worker's view goes
        try:
            x = torch.randn(2, 8, MODEL.d_model)
            mb = "data-0.0-5f1c2a9e"
            assert (
                await send_with_tensor(origin, worker.peer_id, EngineRpcs.forward, forward(origin, worker, mb), x)
            ).accepted
            again = await send_with_tensor(origin, worker.peer_id, EngineRpcs.forward, forward(origin, worker, mb), x)
            assert again.accepted  # taken as a retried stream: the saved graph is not overwritten
            spoofed = await send_with_tensor(
                stranger, worker.peer_id, EngineRpcs.forward, forward(stranger, worker, "x", origin=origin.peer_id), x
            )
            assert not spoofed.accepted and "hop before" in spoofed.reason
            for _ in range(100):
                if home.arrived:
                    break
                await asyncio.sleep(0.1)
            assert home.arrived == 1

            huge = torch.full((2, 8, MODEL.d_model), 3e38)
            with pytest.raises(RemoteError, match="beyond"):
                await send_with_tensor(
                    origin, worker.peer_id, EngineRpcs.backward, backward(worker, mb, origin.peer_id), huge
                )
            grad = torch.randn(2, 8, MODEL.d_model)
            foreign_origin = await send_with_tensor(
                stranger, worker.peer_id, EngineRpcs.backward, backward(worker, mb, stranger.peer_id), grad
            )
            assert not foreign_origin.accepted and "another data node" in foreign_origin.reason
            foreign_sender = await send_with_tensor(
                stranger, worker.peer_id, EngineRpcs.backward, backward(worker, mb, origin.peer_id), grad
            )
            assert not foreign_sender.accepted and "hop after ours" in foreign_sender.reason
            notice = AbandonNotice(microbatch_id=mb, reason="forged\nWARNING all lost")
            assert not (await EngineRpcs(stranger.transport).abandon(worker.peer_id, notice)).accepted

            large = torch.full((2, 8, MODEL.d_model), 6e4)  # within the wire bound: clipped, not refused
            assert (
                await send_with_tensor(
                    origin, worker.peer_id, EngineRpcs.backward, backward(worker, mb, origin.peer_id), large
                )
            ).accepted
            for sender, step, why in ((origin, 2**63 - 1, "beyond any this worker can vouch for"),
                                      (stranger, 0, "not a listed data node of this run")):  # fmt: skip
                hostile = StepClose(step=step, completed=1, abandoned=0)
                refused = await EngineRpcs(sender.transport).step_close(worker.peer_id, hostile)
                assert not refused.accepted and why in refused.reason, refused
            close = StepClose(step=0, completed=1, abandoned=0)  # taken once our gradient has run
            for _ in range(100):
                if (await EngineRpcs(origin.transport).step_close(worker.peer_id, close)).accepted:
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the step close was never taken")
            # sent again (as a data node does when the kept stream it used turns out dead): answered, and
            # no second inner step (inner_steps stays 1 below)
            assert (await EngineRpcs(origin.transport).step_close(worker.peer_id, close)).accepted
            await asyncio.sleep(2.5)  # a heartbeat publishes the record as the closes left it
            y = torch.randn(2, 8, MODEL.d_model)  # the worker still serves, with finite weights
            assert (
                await send_with_tensor(origin, worker.peer_id, EngineRpcs.forward, forward(origin, worker, "after"), y)
            ).accepted
            for _ in range(100):
                if home.arrived == 2:
                    break
                await asyncio.sleep(0.1)
            assert home.arrived == 2
        finally:
            await origin.shutdown()
            await stranger.shutdown()

    asyncio.run(scenario())
    listed = swarm.status(bootstrap.maddrs[0])  # its record (with the clipped norm) still passes the schema
    assert any(n["peer_id"] == worker.peer_id for n in listed["nodes"]), listed
    assert swarm.stop(worker) == 0
    engine = json.loads(stats.read_text())["engine"]
    assert engine["inner_steps"] == 1 and engine["steps_skipped"] == 0
    assert engine["forwards"] == 2 and engine["backwards"] == 1
    assert engine["refused"] >= 5
    assert "forged\nWARNING" not in worker.log() and "heartbeat failed" not in worker.log()


def test_evaluation_floods_are_bounded_and_hostile_ids_never_reach_the_log(swarm, tmp_path):
    _, worker, stats = start_worker(swarm, tmp_path, "--max-inflight", "4")

    async def scenario():
        dht = await client(worker)
        try:
            x = torch.randn(2, 8, MODEL.d_model)
            requests = [forward(dht, worker, f"flood-{i}", needs_backward=False) for i in range(200)]
            sent = (send_with_tensor(dht, worker.peer_id, EngineRpcs.forward, r, x) for r in requests)
            acks = await asyncio.gather(*sent, return_exceptions=True)  # some streams fail at libp2p's own limits
            body = {"microbatch_id": "id\n2026-12-01 WARNING forged\x1b[31m", "origin": dht.peer_id, "step": 0,
                    "hop": 0, "route": [{"stage": 1, "peer_id": worker.peer_id}], "needs_backward": False}  # fmt: skip
            hostile = msgpack.packb({"v": PROTOCOL_VERSION, "t": "fwd", "b": body}, use_bin_type=True)
            # our own encoder would refuse to send it
            refusal = await send_raw_frame(dht.transport, worker.peer_id, EngineRpcs.forward, hostile, Ack)
            assert isinstance(refusal, RemoteError) and "malformed" in str(refusal), refusal
            return acks
        finally:
            await dht.shutdown()

    results = asyncio.run(scenario())
    acks = [a for a in results if isinstance(a, Ack)]
    taken = [a for a in acks if a.accepted]
    assert len(acks) > 100 and all("busy" in a.reason for a in acks if not a.accepted)
    assert len(taken) < len(acks)  # the flood met the in-flight bound
    assert swarm.stop(worker) == 0
    assert json.loads(stats.read_text())["engine"]["forwards"] == len(taken)
    log = worker.log()
    assert "\x1b" not in log and "\nWARNING forged" not in log and "2026-12-01 WARNING forged" not in log
