"""A live stage worker against a second identity that sends it hand-built requests (issue 58): a
stranger's microbatch whose step it never closes, a data node killed mid-step, step closes no data
node could send, and routes that name the worker twice. None may stop the worker's steps, move its
clock, or take it out of its own view. In one process (tests/helpers/inprocess.py): the real engines
and every byte of their RPCs, over the in-memory transport."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import torch

from shoal.node.config import NodeConfig
from shoal.node.hooks import Hooks
from shoal.node.pipeline.worker.admission import route_problem
from shoal.node.pipeline.worker.stage import StageWorker
from shoal.node.pipeline.worker.step_window import STEP_HEADROOM
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import serve
from shoal.p2p.streams import FramedStream
from shoal.protocol.pipeline import Ack, BackwardRequest, ForwardRequest, Hop, StepClose
from shoal.protocol.tensors import TensorSpec
from tests.helpers.inprocess import DATA, InProcessSwarm, corpus_run, data_id, worker_id
from tests.helpers.raw_frames import send_tensor_on
from tests.helpers.tiny import tiny_run

pytestmark = [pytest.mark.timeout(180)]
RUN = {"train.steps": 6, "averaging.mode": "none", "defense.audit_rate": 0.0, "train.eval_every": 0}
STRANGER = "QmStranger"
INT64_MAX = 2**63 - 1


class Stranger:
    """An identity on the swarm's network that no view lists: it sends what it likes, and takes what
    comes back to it as a data node would (keeping nothing)."""

    def __init__(self, swarm: InProcessSwarm):
        self.transport = swarm.network.transport(STRANGER)
        self.rpc = EngineRpcs(self.transport)
        self.width = swarm.run.model.residual_dim
        self.forwards_home = 0
        self.gradients_home = 0

    async def start(self) -> Stranger:
        handlers = {EngineRpcs.forward: self._take_forward, EngineRpcs.backward: self._take_gradient}
        await serve(self.transport, EngineRpcs, handlers, who="stranger")
        return self

    async def _take_forward(self, request: ForwardRequest, stream: FramedStream, sender: str) -> Ack:
        await stream.read_tensor(TensorSpec("float32", (None, None, self.width)))
        self.forwards_home += 1
        return Ack(accepted=True)

    async def _take_gradient(self, request: BackwardRequest, stream: FramedStream, sender: str) -> Ack:
        await stream.read_tensor(TensorSpec("float32", (None, None, self.width)))
        self.gradients_home += 1
        return Ack(accepted=True)

    async def send(self, peer: str, rpc, request: object) -> Ack:
        return await send_tensor_on(self.transport, peer, rpc, request, torch.randn(2, 8, self.width))

    async def microbatch(self, worker: str, step: int) -> None:
        """One training microbatch through `worker` alone, forward and backward, as a data node sends it;
        its step is never closed."""
        route = (Hop(stage=1, peer_id=worker),)
        forward = ForwardRequest(microbatch_id=f"stranger-{step}", origin=STRANGER, step=step, hop=0, route=route)
        assert (await self.send(worker, EngineRpcs.forward, forward)).accepted
        await until(lambda: self.forwards_home == 1, "the stranger's activation to come home")
        backward = BackwardRequest(microbatch_id=forward.microbatch_id, origin=STRANGER, step=step, hop=0, route=route)
        assert (await self.send(worker, EngineRpcs.backward, backward)).accepted
        await until(lambda: self.gradients_home == 1, "the worker's gradient to reach the stranger")


def routed_at_random() -> NodeConfig:
    config = NodeConfig()
    return dataclasses.replace(config, placement=dataclasses.replace(config.placement, routing="random"))


async def until(predicate, what: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def worker(swarm: InProcessSwarm, stage: int) -> StageWorker:
    engine = swarm.engine(worker_id(stage, 0))
    assert isinstance(engine, StageWorker)
    return engine


def inner_steps(swarm: InProcessSwarm) -> list[int]:
    return [worker(swarm, s).progress().inner_step for s in range(1, swarm.run.pipeline.stages)]


def test_a_strangers_microbatch_whose_step_never_closes_does_not_stop_the_data_nodes_steps(tmp_path, caplog) -> None:
    """A stranger sends the stage-1 worker a training forward and its backward, and never closes that
    step. Both are taken (its gradient is kept, and goes into the next inner step), but the inner step
    does not wait for the stranger's close: no view lists it as a data node, so the data node's first
    close releases it, and the worker steps at every one of that data node's closes."""
    run = corpus_run(tmp_path, tiny_run(**RUN))
    swarm = InProcessSwarm(run, {1: 1, 2: 1})

    async def main() -> dict:
        driver = await swarm.start()
        try:
            stranger = await Stranger(swarm).start()
            await stranger.microbatch(worker_id(1, 0), step=0)
            assert worker(swarm, 1).clock.awaited() == {STRANGER: 0}
            return await asyncio.wait_for(driver.work(), 150)
        finally:
            await swarm.close()

    with caplog.at_level(logging.WARNING):
        done = asyncio.run(main())
    assert done["steps"] == run.train.steps
    assert inner_steps(swarm) == [run.train.steps] * 2
    assert f"no longer waiting for {STRANGER[-8:]} to close step 0: not a live data node" in caplog.text


def test_a_data_node_killed_after_contributing_to_a_step_does_not_stop_the_other_data_nodes_steps(tmp_path) -> None:
    """Two data nodes train the swarm; the second is SIGKILLed once its step 1 has gone through every
    worker (its gradient accumulated there) and before it closes that step. Its close never comes: the
    workers stop waiting for it as soon as it leaves their view, and step at each of the first data
    node's closes to the end of the run."""
    run = corpus_run(tmp_path, tiny_run(**RUN))
    victim = data_id(1)
    swarm = InProcessSwarm(run, {1: 1, 2: 1}, data_nodes=2)
    awaited_when_killed: list[int | None] = []  # per worker: the victim's step it waited for a close of

    class KilledBeforeItsClose(Hooks):
        async def before_close_sent(self) -> None:
            if swarm.drivers[1].steps.current_step == 1 and not awaited_when_killed:
                awaited_when_killed.extend(worker(swarm, s).clock.awaited().get(victim) for s in (1, 2))
                swarm.kill_soon(victim)
            if awaited_when_killed:
                await asyncio.Event().wait()  # gone: the close is never sent (the node's stop cancels this)

    swarm.hooks[victim] = KilledBeforeItsClose()

    async def main() -> dict:
        first = await swarm.start()
        second = asyncio.ensure_future(swarm.drivers[1].work())
        try:
            return await asyncio.wait_for(first.work(), 150)
        finally:
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            await swarm.close()

    done = asyncio.run(main())
    assert awaited_when_killed == [1, 1]
    assert done["steps"] == run.train.steps
    assert inner_steps(swarm) == [run.train.steps] * 2


def test_step_closes_no_listed_data_node_could_send_are_refused_and_change_nothing(tmp_path) -> None:
    """The data node (listed) closes step 2^63-1, a step within the run but far past any it published,
    and step -1; a stranger that has had one training microbatch taken closes its step, and step
    2^63-1. Each is refused with its reason; the worker's step clock, inner step and schedule stay as
    they were, and the record it would publish still passes the schema (it stays in the swarm). An
    honest close of the data node's step 0 is still taken."""
    run = corpus_run(tmp_path, tiny_run(**{**RUN, "train.steps": 1000}))
    swarm = InProcessSwarm(run, {1: 1, 2: 1})
    stage1 = worker_id(1, 0)

    async def main() -> dict[str, Ack]:
        await swarm.start()
        try:
            stranger = await Stranger(swarm).start()
            await stranger.microbatch(stage1, step=0)
            senders = {DATA: EngineRpcs(swarm.members[DATA].ctx.transport), STRANGER: stranger.rpc}

            async def close(sender: str, step: int) -> Ack:
                return await senders[sender].step_close(stage1, StepClose(step=step, completed=1, abandoned=0))

            acks = {
                "data: 2^63-1": await close(DATA, INT64_MAX),
                "data: far ahead": await close(DATA, 10 * STEP_HEADROOM),
                "data: -1": await close(DATA, -1),
                "stranger: its step": await close(STRANGER, 0),
                "stranger: 2^63-1": await close(STRANGER, INT64_MAX),
            }
            w = worker(swarm, 1)
            clock = (w.clock.heard, w.clock.handled, w.clock.closed_step, w.optimizer.step_count)
            assert clock == ({}, {}, -1, 0), clock
            assert swarm.published_record(stage1).inner_step == 0
            acks["data: step 0"] = await close(DATA, 0)
            return acks
        finally:
            await swarm.close()

    acks = asyncio.run(main())
    assert acks.pop("data: step 0").accepted
    assert not any(ack.accepted for ack in acks.values()), acks
    assert "beyond any this worker can vouch for" in acks["data: 2^63-1"].reason
    assert "beyond any this worker can vouch for (at most 64)" in acks["data: far ahead"].reason
    assert "below 0" in acks["data: -1"].reason
    assert {acks[k].reason for k in ("stranger: its step", "stranger: 2^63-1")} == {
        "not a listed data node of this run"
    }
    assert worker(swarm, 1).stats()["refused"] == 5
    assert swarm.published_record(stage1).inner_step == 0


def test_a_route_naming_the_worker_twice_is_refused_and_the_worker_stays_in_its_own_view(tmp_path) -> None:
    """An evaluation forward whose route names the stage-1 worker at its first two hops would have it
    pass its output to itself: a dial to oneself fails, and the worker suspected itself and left its
    own view for good. The first hop now refuses the route, and the worker never suspects itself.
    Routed as the bundled run routes (random replicas, NoLoCo's default): the route is followed as
    written, where GWTF would pick the next hop itself."""
    run = corpus_run(tmp_path, tiny_run(**RUN))
    swarm = InProcessSwarm(run, {1: 1, 2: 1}, routed_at_random())
    stage1 = worker_id(1, 0)

    async def main() -> Ack:
        await swarm.start()
        try:
            stranger = await Stranger(swarm).start()
            route = (Hop(stage=1, peer_id=stage1), Hop(stage=2, peer_id=stage1))
            request = ForwardRequest(microbatch_id="twice", origin=STRANGER, step=-1, hop=0, route=route,
                                     needs_backward=False)  # fmt: skip
            ack = await stranger.send(stage1, EngineRpcs.forward, request)
            await until(lambda: not worker(swarm, 1).forwarder.forwarding, "the forward to be over")
            return ack
        finally:
            await swarm.close()

    ack = asyncio.run(main())
    assert not ack.accepted and ack.reason == "the route names one peer at two places"
    ctx = swarm.members[stage1].ctx
    assert stage1 not in ctx.suspects
    view = ctx.view
    assert view is not None and stage1 in {n.peer_id for n in view.replicas(1)}


@pytest.mark.parametrize(
    ("origin", "stages_peers", "problem"),
    [
        ("D", [(1, "A"), (2, "B"), (3, "C")], None),
        ("D", [(2, "B"), (1, "A"), (3, "C")], None),  # neighbours swapped (CheckFree+, SkipPipe)
        ("D", [(1, "A"), (3, "C")], None),  # a stage skipped (SkipPipe), or an audit's partial path
        ("D", [(1, "A"), (2, "A")], "the route names one peer at two places"),
        ("A", [(1, "A"), (2, "B")], "the route names one peer at two places"),  # the receiver as its sender
        ("D", [(1, "A"), (2, "D")], "the route names one peer at two places"),  # the data node as a hop
        ("D", [(3, "C"), (1, "A")], "the route's stages (3, 1) are out of order"),
        ("D", [(1, "A"), (1, "B")], "the route's stages (1, 1) are out of order"),
        ("D", [(0, "A")], "the route names a stage outside 1..3"),
        ("D", [(4, "A")], "the route names a stage outside 1..3"),
    ],
)
def test_a_route_is_taken_only_in_a_shape_a_data_node_sends(origin, stages_peers, problem) -> None:
    route = tuple(Hop(stage=s, peer_id=p) for s, p in stages_peers)
    assert route_problem(origin, route, stages=4) == problem


@pytest.mark.parametrize(("counter", "value"), [("inner_step", 10**12), ("outer_epoch", 5)])
def test_a_joiner_refuses_a_copy_whose_counters_no_replica_of_the_run_stands_at(tmp_path, counter, value) -> None:
    """Stage 1 has two replicas; the first, which a joiner asks first, then stands at an inner step far
    past the run's last (the learning-rate schedule's end, and a record every peer refuses), or at outer
    epoch 5 after no inner step (no outer step would come due for a long while, and every partner's
    gossip be refused as over). A third replica joining by copy refuses that copy, marks its donor
    failed, and copies the second: it starts at inner step 0, epoch 0."""
    run = corpus_run(tmp_path, tiny_run(**{**RUN, "averaging.mode": "noloco"}))
    swarm = InProcessSwarm(run, {1: 2, 2: 1})

    async def main() -> tuple[str | None, StageWorker]:
        await swarm.start()
        try:
            donor = worker(swarm, 1)
            assert donor.averager is not None
            if counter == "inner_step":
                donor.optimizer.step_count = value
            else:
                donor.averager.epoch = value
            joiner = await swarm.add_worker(1, worker_id(1, 2))
            return await joiner.join_by_copy(), joiner
        finally:
            await swarm.close()

    source, joiner = asyncio.run(main())
    assert source == worker_id(1, 1)
    assert set(joiner.failed_donors) == {worker_id(1, 0)}
    assert joiner.averager is not None
    assert (joiner.optimizer.step_count, joiner.averager.epoch) == (0, 0)
