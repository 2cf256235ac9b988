"""A live worker on an int8 wire (`pipeline.wire_dtype = "int8"`) refuses hostile compressed frames
(a non-finite, negative or out-of-bound scale, -128, values of another width or for other rows, scales
of another rank or dtype) with `bad_tensor`, changes nothing (its counters stay where they were, it
holds no microbatch), and then takes a well-formed int8 activation as before.

Run: .venv/bin/python -m pytest tests/test_node_int8_wire.py -q
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import RemoteError, read_reply
from shoal.protocol.codec import encode
from shoal.protocol.pipeline import Ack, ForwardRequest, Hop
from shoal.protocol.torch_tensors import quantize_rows
from shoal.run_files import load_run_config
from tests.helpers.processes import metrics
from tests.helpers.raw_frames import unchecked_frames
from tests.helpers.tiny import write_tiny_run

SERVED = "shoal_microbatches_served_total"
STATE = ("shoal_inner_step", "shoal_outer_epoch", "shoal_microbatches_in_flight",
         f'{SERVED}{{pass="forward"}}', f'{SERVED}{{pass="backward"}}',
         'shoal_errors_total{kind="rpc_internal"}', 'shoal_errors_total{kind="training"}')  # fmt: skip


def _state(peer) -> dict[str, float]:
    samples = metrics(peer)
    return {name: samples.get(name, 0.0) for name in STATE}


def _hostile(scales: torch.Tensor, values: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """Named (scales, values, the scales' wire dtype) pairs, each wrong in one way."""

    def changed(tensor: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
        out = tensor.clone()
        out[index] = value
        return out

    return {
        "non-finite scale": (changed(scales, (0, 0), float("nan")), values, "float32"),
        "infinite scale": (changed(scales, (1, 3), float("inf")), values, "float32"),
        "negative scale": (changed(scales, (1, 2), -1.0), values, "float32"),
        "scale beyond the bound": (changed(scales, (0, 1), 1e30), values, "float32"),
        "-128": (scales, changed(values, (0, 0, 0), -128), "float32"),
        "values of another width": (scales, values[..., :-1].contiguous(), "float32"),
        "values for other rows": (scales, values[:1].contiguous(), "float32"),
        "scales of another rank": (scales[0].contiguous(), values, "float32"),
        "scales not float32": (scales.to(torch.bfloat16), values, "bfloat16"),
    }


@pytest.mark.multiprocess
def test_an_int8_worker_refuses_hostile_compressed_frames_and_changes_nothing(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"pipeline.wire_dtype": "int8"})
    run = load_run_config(str(run_file))
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    worker = swarm.start_node([entry], "--role", "worker", "--metrics-port", "0")
    b, t, d = run.train.microbatch_size, run.train.seq_len, run.model.d_model
    scales, values = quantize_rows(torch.randn(b, t, d))

    async def scenario() -> tuple[dict[str, str], str, dict, dict]:
        client = await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)
        route = (Hop(stage=worker.stage, peer_id=worker.peer_id),)

        async def send(microbatch: str, scales: torch.Tensor, values: torch.Tensor, scale_dtype: str) -> str:
            request = ForwardRequest(microbatch_id=microbatch, origin=client.peer_id, step=0, hop=0, route=route)
            stream = await client.transport.open(worker.peer_id, EngineRpcs.forward.protocol, 10)
            try:
                await stream.write_frames([encode(request), *unchecked_frames(scales, scale_dtype)])
                await stream.write_frames(unchecked_frames(values, "int8"), False)
                ack = await read_reply(stream, Ack)
                return "accepted" if ack.accepted else f"declined: {ack.reason}"
            except RemoteError as error:
                return error.code
            finally:
                stream.close()

        try:
            before = _state(worker)
            cases = _hostile(scales, values).items()
            answers = {what: await send(f"hostile-{i}", *case) for i, (what, case) in enumerate(cases)}
            after = _state(worker)
            good = await send("well-formed", scales, values, "float32")
            return answers, good, before, after
        finally:
            await client.shutdown()

    answers, good, before, after = asyncio.run(scenario())
    assert answers == dict.fromkeys(answers, "bad_tensor"), answers
    assert after == before, (before, after)  # nothing served, nothing held, no internal error
    assert good == "accepted"  # and the same stream of frames, well formed, is taken as before
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()
