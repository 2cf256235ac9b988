"""Join by copy with AdamW's moments (shoal/node/stage/copy.py), over a real libp2p stream between two
hosts in this process: a data node joining others that step stage 0 on one mean gradient takes the
donor's moments as sent, and refuses a donor whose second moments are negative (their square root
would turn its first step into NaN) or who sends moments it was not asked for."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from shoal.node.rpcs import EngineRpcs
from shoal.node.stage.copy import fetch_stage
from shoal.p2p.rpc import serve
from shoal.p2p.streams import FramedStream
from shoal.p2p.transport import Libp2pTransport
from shoal.protocol.errors import BadTensor
from shoal.protocol.pipeline import Ack, StageCopy, StageCopyRequest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

THETA = [torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.ones(3)]
EXP_AVG = [torch.full_like(t, 0.01) for t in THETA]
EXP_AVG_SQ = [torch.full_like(t, 1e-4) for t in THETA]


class _Donor:
    """Serves stage copies as a live replica would, with the second moments it is given, and with
    moments whether or not it was asked for them (`always`)."""

    def __init__(self, exp_avg_sq: list[torch.Tensor], always: bool = False):
        self.exp_avg_sq, self.always = exp_avg_sq, always

    async def copy_stage(self, request: StageCopyRequest, stream: FramedStream, sender: str) -> None:
        moments = request.moments or self.always
        await stream.write_message(Ack(accepted=True))
        steps = (12.0,) * len(THETA) if moments else ()
        await stream.write_message(StageCopy(inner_step=12, outer_epoch=1, tensors=len(THETA), adam_steps=steps))
        extra = (*EXP_AVG, *self.exp_avg_sq) if moments else ()
        for tensor in (*THETA, *THETA, *extra):
            await stream.write_tensor(tensor, "float32", kind="copy")


async def _fetch(donor: _Donor, moments: bool):
    host = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    try:
        await serve(Libp2pTransport(host), EngineRpcs, {EngineRpcs.copy_stage: donor.copy_stage}, who="donor")
        maddrs = [str(m) for m in await host.get_visible_maddrs()]
        joiner = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        try:
            reference = [torch.empty_like(t) for t in THETA]
            return await fetch_stage(
                Libp2pTransport(joiner), host.peer_id.to_base58(), 0, reference, 10.0, moments=moments
            )
        finally:
            await joiner.shutdown()
    finally:
        await host.shutdown()


def test_a_joiner_takes_the_donors_moments_and_refuses_negative_or_unasked_ones():
    fetched = asyncio.run(_fetch(_Donor(EXP_AVG_SQ), moments=True))
    assert fetched.moments is not None and fetched.moments.adam_steps == (12.0, 12.0)
    assert fetched.moments.step_count == fetched.inner_step == 12
    assert all(torch.equal(a, b) for a, b in zip(fetched.moments.exp_avg, EXP_AVG, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fetched.moments.exp_avg_sq, EXP_AVG_SQ, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fetched.theta, THETA, strict=True))

    plain = asyncio.run(_fetch(_Donor(EXP_AVG_SQ), moments=False))
    assert plain.moments is None

    negative = [-t for t in EXP_AVG_SQ]
    with pytest.raises(BadTensor, match="negative"):
        asyncio.run(_fetch(_Donor(negative), moments=True))
    with pytest.raises(BadTensor, match="AdamW steps"):
        asyncio.run(_fetch(_Donor(EXP_AVG_SQ, always=True), moments=False))
