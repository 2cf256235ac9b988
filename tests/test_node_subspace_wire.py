"""A live worker of a Subspace Network's run (`model.subspace_rank = k`) takes an activation only as
k coefficients a token with exactly the microbatch's token ids beside it: ids missing, truncated or
outside the vocabulary, or a d-wide activation, are refused with `bad_tensor` and change nothing (its
counters stay where they were, it holds no microbatch); then a well-formed forward is taken as
before. A worker of a run without a subspace refuses token ids it does not take.

Run: .venv/bin/python -m pytest tests/test_node_subspace_wire.py -q
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.dht.identity import load_identity
from shoal.dht.swarm import SwarmDHT
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import RemoteError
from shoal.protocol.pipeline import ForwardRequest, Hop
from shoal.protocol.torch_tensors import pack_tokens
from shoal.run_files import load_run_config
from tests.helpers.processes import metrics
from tests.helpers.raw_frames import send_with_tensor
from tests.helpers.tiny import write_tiny_run

SERVED = "shoal_microbatches_served_total"
STATE = ("shoal_microbatches_in_flight", f'{SERVED}{{pass="forward"}}', 'shoal_errors_total{kind="rpc_internal"}',
         'shoal_errors_total{kind="training"}')  # fmt: skip


def _state(peer) -> dict[str, float]:
    samples = metrics(peer)
    return {name: samples.get(name, 0.0) for name in STATE}


def _forwards(swarm, run_file, cases: dict[str, tuple[torch.Tensor, bytes]]) -> tuple[dict, dict, dict]:
    """Each case's answer from a fresh worker of `run_file`, and its state before and after them all."""
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    worker = swarm.start_node([entry], "--role", "worker", "--metrics-port", "0")

    async def scenario() -> tuple[dict[str, str], dict, dict]:
        client = await SwarmDHT.create(load_identity(None), initial_peers=worker.maddrs, client_mode=True)
        route = (Hop(stage=worker.stage, peer_id=worker.peer_id),)

        async def send(microbatch: str, x: torch.Tensor, tokens: bytes) -> str:
            request = ForwardRequest(microbatch_id=microbatch, origin=client.peer_id, step=0, hop=0, route=route,
                                     needs_backward=False, tokens=tokens)  # fmt: skip
            try:
                ack = await send_with_tensor(client, worker.peer_id, EngineRpcs.forward, request, x)
            except RemoteError as error:
                return error.code
            return "accepted" if ack.accepted else f"declined: {ack.reason}"

        try:
            before = _state(worker)
            hostile = {what: case for what, case in cases.items() if what != "well-formed"}
            answers = {what: await send(f"hostile-{i}", *case) for i, (what, case) in enumerate(hostile.items())}
            after = _state(worker)
            if "well-formed" in cases:
                answers["well-formed"] = await send("well-formed", *cases["well-formed"])
            return answers, before, after
        finally:
            await client.shutdown()

    answers, before, after = asyncio.run(scenario())
    assert worker.process.poll() is None
    assert "Traceback" not in worker.log()
    return answers, before, after


@pytest.mark.multiprocess
def test_a_subspace_worker_refuses_bad_token_ids_or_widths_and_changes_nothing(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"model.subspace_rank": 8, "pipeline.wire_dtype": "float32"})
    run = load_run_config(str(run_file))
    b, t, vocab = run.train.microbatch_size, run.train.seq_len, run.model.vocab_size
    tokens = torch.randint(0, vocab, (b, t))
    ids, x = pack_tokens(tokens, vocab), torch.randn(b, t, 8)
    out_of_vocabulary = tokens.clone()
    out_of_vocabulary[1, 2] = vocab
    answers, before, after = _forwards(swarm, run_file, {
        "no token ids": (x, b""),
        "truncated ids": (x, ids[:-2]),
        "an id too many": (x, ids + ids[:2]),
        "an id outside the vocabulary": (x, pack_tokens(out_of_vocabulary, 1 << 16)),
        "a d-wide activation": (torch.randn(b, t, run.model.d_model), ids),
        "well-formed": (x, ids),
    })  # fmt: skip
    well_formed = answers.pop("well-formed")
    assert answers == dict.fromkeys(answers, "bad_tensor"), answers
    assert after == before, (before, after)
    assert well_formed == "accepted"


@pytest.mark.multiprocess
def test_a_worker_without_a_subspace_refuses_token_ids(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"pipeline.wire_dtype": "float32"})
    run = load_run_config(str(run_file))
    b, t, vocab = run.train.microbatch_size, run.train.seq_len, run.model.vocab_size
    x = torch.randn(b, t, run.model.d_model)
    answers, before, after = _forwards(swarm, run_file, {
        "token ids": (x, pack_tokens(torch.randint(0, vocab, (b, t)), vocab)), "well-formed": (x, b""),
    })  # fmt: skip
    assert answers == {"token ids": "bad_tensor", "well-formed": "accepted"}, answers
    assert after == before
