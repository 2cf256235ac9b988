"""A live data node against hand-built messages (issue 58): from the hops of its own microbatches, a
route that comes back other than the data node sent it and a training microbatch that comes home
marked as an evaluation; from another data node, a gradient share for a step far from its own. The
data node keeps its own route, its own idea of the microbatch and its own step. In one process
(tests/helpers/inprocess.py): the real engines and every byte of their RPCs, over the in-memory
transport."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.node.hooks import Hooks
from shoal.node.pipeline.data.attempts import InFlight
from shoal.node.pipeline.worker.step_window import STEP_HEADROOM
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.streams import read_reply
from shoal.protocol.pipeline import Ack, ForwardRequest, GradientShare, Hop
from tests.helpers.inprocess import DATA, InProcessSwarm, corpus_run, data_id, worker_id
from tests.helpers.raw_frames import send_tensor_on
from tests.helpers.tiny import tiny_run
from tests.test_node_worker_trust import INT64_MAX, RUN, routed_at_random, until

pytestmark = [pytest.mark.timeout(180)]
LAST = worker_id(2, 0)


class HeldAfterForward(Hooks):
    """The last stage's worker computes its forwards and holds each output until `release` is set: the
    data node's microbatches stay in forward, waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def after_forward(self) -> None:
        await self.release.wait()


class HeldSwarm:
    """A three-stage swarm (a data node, one replica of stages 1 and 2) whose last worker holds its
    outputs; `home` sends, as that worker, a forward home to the data node with the route it is given."""

    def __init__(self, tmp_path) -> None:
        self.held = HeldAfterForward()
        run = corpus_run(tmp_path, tiny_run(**RUN))
        self.swarm = InProcessSwarm(run, {1: 1, 2: 1}, routed_at_random(), hooks={LAST: self.held})
        self.work: asyncio.Future | None = None

    async def start(self) -> tuple[str, InFlight]:
        """The swarm, training; returns a training microbatch of the data node's in forward."""
        driver = await self.swarm.start()
        self.work = asyncio.ensure_future(driver.work())
        in_flight = driver.attempts.in_flight
        await until(lambda: any(e.train and not e.home for e in in_flight.values()), "a microbatch in flight")
        return next((wire_id, e) for wire_id, e in in_flight.items() if e.train and not e.home)

    async def home(self, wire_id: str, entry: InFlight, route: tuple[Hop, ...], needs_backward: bool = True) -> Ack:
        request = ForwardRequest(microbatch_id=wire_id, origin=DATA, step=entry.step, hop=len(route), route=route,
                                 needs_backward=needs_backward)  # fmt: skip
        x = torch.randn(*entry.targets.shape, self.swarm.run.model.residual_dim)
        return await send_tensor_on(self.swarm.members[LAST].ctx.transport, DATA, EngineRpcs.forward, request, x)

    async def close(self) -> None:
        self.held.release.set()
        if self.work is not None:
            self.work.cancel()
            await asyncio.gather(self.work, return_exceptions=True)
        await self.swarm.close()


def test_a_route_home_other_than_the_data_nodes_is_refused_and_the_data_node_keeps_its_own(tmp_path) -> None:
    """The last hop of a training microbatch sends its activation home with a route one hop longer than
    the data node sent (which made a step audit's strict zip of the route's peers and stages raise in
    the step loop), and with a route naming a peer no view lists at stage 1. Both are refused, and the
    data node's route stays as it was; the microbatch is still in forward."""
    held = HeldSwarm(tmp_path)

    async def main() -> dict[str, Ack]:
        try:
            wire_id, entry = await held.start()
            ours = entry.route_peers
            assert entry.route_stages == (1, 2) and ours == (worker_id(1, 0), LAST)
            longer = (Hop(stage=1, peer_id=ours[0]), Hop(stage=1, peer_id="QmElsewhere"), Hop(stage=2, peer_id=LAST))
            unlisted = (Hop(stage=1, peer_id="QmElsewhere"), Hop(stage=2, peer_id=LAST))
            acks = {
                "longer": await held.home(wire_id, entry, longer),
                "unlisted": await held.home(wire_id, entry, unlisted),
            }
            assert entry.route_peers == ours and entry.route_stages == (1, 2)
            assert not entry.home and entry.backward is None
            return acks
        finally:
            await held.close()

    acks = asyncio.run(main())
    assert not any(ack.accepted for ack in acks.values()), acks
    assert acks["longer"].reason == "the route's stages (1, 1, 2) are not those of this microbatch (1, 2)"
    assert acks["unlisted"].reason == "the route names a peer at stage 1 that holds no replica of it"


def test_a_training_microbatch_home_marked_as_an_evaluation_still_gets_its_backward(tmp_path) -> None:
    """The last hop sends a training microbatch's activation home saying it needs no backward. Its loss
    was computed without a gradient and it counted as completed, its loss and tokens in the step's; the
    data node now goes by its own record of the attempt: it computes the gradient and sends it back."""
    held = HeldSwarm(tmp_path)

    async def main() -> Ack:
        try:
            wire_id, entry = await held.start()
            route = tuple(Hop(stage=s, peer_id=p) for s, p in zip(entry.route_stages, entry.route_peers, strict=True))
            ack = await held.home(wire_id, entry, route, needs_backward=False)
            await until(lambda: entry.backward is not None or entry.done.done(), "the loss to be computed")
            assert entry.backward is not None and entry.backward.route == route
            assert not entry.done.done()  # completed only once its gradient reaches the embedding
            return ack
        finally:
            await held.close()

    assert asyncio.run(main()).accepted


def test_a_gradient_share_for_a_step_far_from_the_data_nodes_own_is_refused_and_changes_nothing(tmp_path) -> None:
    """Two data nodes average stage 0's gradients. Before either has stepped, the first sends the
    second its gradients for step 2^63-1, and for a step within the run but far past the second's own.
    They set the step the second was last called for past every step it takes, and from then on it
    stepped stage 0 alone; both are now refused, as a worker's step window refuses such a step, and
    change nothing. A share for step 0 is still taken (and waited for, in vain: nobody steps here)."""
    settings = {**RUN, "train.steps": 1000, "averaging.mode": "noloco", "averaging.stage0": "gradients",
                "averaging.exchange_timeout_s": 1.0}  # fmt: skip
    swarm = InProcessSwarm(corpus_run(tmp_path, tiny_run(**settings)), {1: 1, 2: 1}, data_nodes=2)

    async def main() -> dict[str, Ack]:
        await swarm.start()
        try:
            sender, receiver = (driver.gradients for driver in swarm.drivers)
            assert sender is not None and receiver is not None
            pieces, _, _ = sender.codec.encode_delta([torch.zeros(shape) for shape in sender.shapes], None)

            async def share(step: int) -> Ack:
                stream = await swarm.drivers[0].ctx.rpc.gradient_share.open(data_id(1), 10.0)
                try:
                    await stream.write_message(GradientShare(step=step, tensors=len(sender.shapes)))
                    await sender._send(stream, pieces)
                    return await read_reply(stream, Ack)
                finally:
                    stream.close()

            acks = {"2^63-1": await share(INT64_MAX), "far ahead": await share(10 * STEP_HEADROOM)}
            assert (receiver.called_for, receiver.step) == (-1, -1)
            acks["step 0"] = await share(0)
            assert receiver.called_for == 0
            return acks
        finally:
            await swarm.close()

    acks = asyncio.run(main())
    assert not any(ack.accepted for ack in acks.values()), acks
    assert acks["2^63-1"].reason == f"step {INT64_MAX} is beyond any this data node can vouch for (at most 64)"
    assert acks["far ahead"].reason == "step 640 is beyond any this data node can vouch for (at most 64)"
    assert acks["step 0"].reason == "not at step 0 in time"
