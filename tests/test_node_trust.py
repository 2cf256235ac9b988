"""A worker against a peer that sends it hand-built pipeline requests: repeats, floods, foreign ids,
huge gradients. Each is refused or taken as already done, and the worker keeps training."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.transport import open_call, read_reply
from shoal.protocol.pipeline import Ack, ForwardRequest, Hop
from tests.helpers.tiny import tiny_run, write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


async def send_forward(client: SwarmDHT, peer_id: str, request: ForwardRequest, x: torch.Tensor) -> Ack:
    stream = await open_call(client.p2p, peer_id, "rpc_forward", timeout_s=10)
    try:
        await stream.write_message(request)
        await stream.write_tensor(x, "float32")
        return await read_reply(stream, Ack)
    finally:
        stream.close()


def test_a_repeated_evaluation_forward_runs_once(swarm, tmp_path):
    """A sender whose ack was lost sends the same microbatch again: the worker answers "taken" and
    does not run (and pass on) the forward a second time, even once the first is long done."""
    run_file = write_tiny_run(tmp_path, **{"pipeline.wire_dtype": "float32"})
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file))
    stats = tmp_path / "worker.json"
    worker = swarm.start_node([bootstrap.maddrs[0]], "--role", "worker", "--stage", "1", "--stats-file", str(stats))
    model = tiny_run().model

    async def scenario():
        client = await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)
        try:
            request = ForwardRequest(
                microbatch_id="evaluation-repeat",
                origin=client.peer_id,
                step=-1,
                hop=0,
                route=(Hop(stage=1, peer_id=worker.peer_id),),
                needs_backward=False,
            )
            x = torch.randn(2, 8, model.d_model)
            first = await send_forward(client, worker.peer_id, request, x)
            await asyncio.sleep(2.0)  # the first forward is done and its output sent on (or given up)
            second = await send_forward(client, worker.peer_id, request, x)
            return first, second
        finally:
            await client.shutdown()

    first, second = asyncio.run(scenario())
    assert first.accepted and second.accepted
    assert swarm.stop(worker) == 0
    assert json.loads(stats.read_text())["engine"]["forwards"] == 1
