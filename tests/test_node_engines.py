"""The engines in one process, through the interface the node uses (shoal/node/engine.py): no daemon,
no peers. A `NodeContext` is built from real parts (a router, a link monitor, a view holder, a
recording publisher); the network is not used, so these check what an engine reports and keeps,
while the multi-process tests check what only real peers show."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest
import torch

from shoal.node.config import ExperimentOptions, LimitOptions, NodeConfig
from shoal.node.context import NodeContext
from shoal.node.engine import Engine, Progress
from shoal.node.engines import node_hooks, run_cost_model
from shoal.node.hooks import Hooks
from shoal.node.pipeline.data.driver import DataDriver
from shoal.node.pipeline.worker.stage import StageWorker
from shoal.node.rollout.worker import RolloutWorker
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.links import LinkMonitor
from shoal.p2p.memory import MemoryNetwork
from shoal.planning.peer_router import PeerRouter, Snapshot
from shoal.planning.swarm_view import NodeInfo, SwarmView
from shoal.protocol.pipeline import ForwardRequest, Hop, ResumeForward
from tests.helpers.tiny import tiny_run

PEER = "QmEngineTestPeer000000000000000000000000000001"
DATA = "QmEngineTestData000000000000000000000000000001"


class Published:
    """Counts the node-record publications an engine asks for."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> bool:
        self.count += 1
        return True


def context(run, config: NodeConfig | None = None, hooks: Hooks | None = None) -> NodeContext:
    async def no_fresh_view():
        raise RuntimeError("no DHT in this test")

    return NodeContext(
        peer_id=PEER,
        run=run,
        config=config or NodeConfig(),
        transport=MemoryNetwork().transport(PEER),
        router=PeerRouter("gwtf", run_cost_model(run), seed=PEER),
        links=LinkMonitor(None, PEER),
        started_at=0.0,
        max_inflight=4,
        current_view=lambda: None,
        read_view=no_fresh_view,
        publish=Published(),
        hooks=hooks or Hooks.none(),
    )


ENGINE_MEMBERS = [name for name in dir(Engine) if not name.startswith("_")]


@pytest.mark.parametrize("engine_type", [DataDriver, StageWorker, RolloutWorker])
def test_every_engine_provides_every_member_of_the_interface(engine_type) -> None:
    missing = [name for name in ENGINE_MEMBERS if not hasattr(engine_type, name)]
    assert not missing, f"{engine_type.__name__} lacks {missing}"
    for name in ("start", "work", "stop", "state_dict", "load_state_dict", "join_by_copy"):
        assert inspect.iscoroutinefunction(getattr(engine_type, name)), f"{engine_type.__name__}.{name}"


def test_every_engine_names_its_handlers_by_their_declarations() -> None:
    """A handler keyed by anything but an `EngineRpcs` declaration would never be found: refused, silently."""

    async def main() -> None:
        run = tiny_run()
        engines = [DataDriver(context(run)), StageWorker(context(run), 1)]
        try:
            for engine in engines:
                declared = set(EngineRpcs.rpcs().values())
                assert engine.handlers() and set(engine.handlers()) <= declared, type(engine).__name__
                for rpc, handler in engine.handlers().items():
                    arity = len(inspect.signature(handler).parameters)
                    assert arity == (3 if rpc.streamed else 2), f"{type(engine).__name__} {rpc.name}: {arity} args"
        finally:
            for engine in engines:
                await engine.stop()

    asyncio.run(main())


def _one_inner_step(worker: StageWorker, seed: int) -> None:
    x = torch.randn(2, 8, worker.run.model.d_model, generator=torch.Generator().manual_seed(seed))
    worker.module(x).pow(2).mean().backward()
    stats = worker.optimizer.step()
    worker.grad_norms.note(stats.grad_norm, worker.run.optim.grad_clip)


def test_a_stage_worker_reports_its_progress_and_its_state_loads_into_another_bit_for_bit() -> None:
    async def main() -> None:
        run = tiny_run(**{"averaging.mode": "noloco"})
        worker, other = StageWorker(context(run), 1), StageWorker(context(run), 1)
        try:
            assert worker.progress() == Progress()  # nothing trained yet: what a fresh record says
            assert {rpc.name for rpc in worker.handlers()} >= {
                "forward",
                "backward",
                "step_close",
                "gossip",
                "copy_stage",
            }
            for seed in range(3):
                _one_inner_step(worker, seed)
            progress = worker.progress()
            assert progress.inner_step == 3 and progress.grad_norm is not None
            assert progress.grad_norm_clipped == min(progress.grad_norm, run.optim.grad_clip)
            state = await worker.state_dict()
            assert state is not None and state.inner_step == 3 and state.phi is not None
            await other.load_state_dict(state)
            assert other.progress().inner_step == 3
            for a, b in zip(worker.module.parameters(), other.module.parameters(), strict=True):
                assert torch.equal(a, b)
            _one_inner_step(worker, 7)
            _one_inner_step(other, 7)
            for a, b in zip(worker.module.parameters(), other.module.parameters(), strict=True):
                assert torch.equal(a, b)  # the optimizer state came along too
            worker.averager.stepping = True  # an outer step under way: no snapshot of new φ with old θ
            assert await worker.state_dict() is None
        finally:
            await worker.stop()
            await other.stop()

    asyncio.run(main())


def test_a_lonely_noloco_outer_step_is_logged_as_a_typed_record_and_moves_the_epoch() -> None:
    async def main() -> None:
        run = tiny_run(**{"averaging.mode": "noloco"})
        worker = StageWorker(context(run), 2)
        try:
            _one_inner_step(worker, 0)
            await worker.averager.outer_step(1)  # no view, so no partner: a local outer step
            step = worker.averager.outer_log[-1]
            assert (step.epoch, step.partner, step.took_partner, step.partner_gap) == (1, None, False, None)
            assert step.own_delta_norm > 0
            assert worker.progress().outer_epoch == 1
            assert worker.stats()["averaging"]["outer_log"] == [step.as_list()]
        finally:
            await worker.stop()

    asyncio.run(main())


def test_a_data_node_resumes_at_its_saved_step() -> None:
    async def main() -> None:
        run = tiny_run()
        driver, resumed = DataDriver(context(run)), DataDriver(context(run))
        try:
            tokens = torch.randint(0, run.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
            driver.head.loss(driver.head.embed(tokens[:, :-1]), tokens[:, 1:]).backward()
            driver.optimizer.step()
            state = await driver.state_dict()
            await resumed.load_state_dict(state)
            assert resumed.steps.first_step == 1 and resumed.progress().inner_step == 1
            assert {rpc.name for rpc in driver.handlers()} == {
                "forward",
                "backward",
                "fetch_output",
                "abandon",
                "route_note",
                "copy_stage",
                "gossip",
                "gradient_share",
            }
            assert await driver.join_by_copy() is None  # no other data node in its view: nothing to copy
        finally:
            await driver.stop()
            await resumed.stop()

    asyncio.run(main())


def test_a_node_without_fault_flags_gets_hooks_that_change_nothing() -> None:
    hooks = node_hooks(NodeConfig())
    y = torch.randn(2, 3, 4)
    assert hooks.activation(y) is y and hooks.gradient(y) is y
    assert not hooks.alters_weights and hooks.stage_attack_name is None
    hooks.before_forward(10**6, "test")  # no crash step: returns

    async def main() -> None:
        await asyncio.wait_for(hooks.after_forward(), 0.5)
        await asyncio.wait_for(hooks.before_close_sent(), 0.5)
        await asyncio.wait_for(hooks.on_close(0, "test"), 0.5)
        await asyncio.wait_for(hooks.before_upstream(0, 1, "mb", "peer", "test"), 0.5)

    asyncio.run(main())
    injected = node_hooks(NodeConfig(experiment=ExperimentOptions(upstream_delay=(3, 1.5), forward_delay_s=0.25)))
    assert injected.faults.upstream_delay == (3, 1.5) and injected.faults.forward_delay_s == 0.25


def test_nothing_under_node_probes_an_engine_by_attribute_name() -> None:
    """The node asks its engine through `Engine` only: a renamed attribute must fail loudly, not turn
    into a default."""
    import ast
    from pathlib import Path

    import shoal.node

    probes = []
    for path in Path(shoal.node.__file__).parent.rglob("*.py"):
        for call in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id in ("getattr", "hasattr")
            ):
                target = ast.unparse(call.args[0]) if call.args else ""
                if "engine" in target or "averager" in target:
                    probes.append(f"{path.name}:{call.lineno} {ast.unparse(call)}")
    assert not probes, probes


def test_waiting_on_the_view_returns_what_it_waited_for_or_none_at_its_bound() -> None:
    """`NodeContext.wait_for`, the one "wait until the swarm shows X": it looks again while nothing is
    found (saying so), returns the first thing found, reads afresh when asked, and gives up on time."""
    run = tiny_run()
    views: list[SwarmView | None] = [None, SwarmView(run.run_id, 3, (0, 2, 2))]
    replica = NodeInfo("QmReplica", "worker", 1, "active", 1.0, 2)
    views.append(SwarmView(run.run_id, 3, (0, 2, 2), nodes=(replica,)))
    reads: list[int] = []

    async def read_view() -> SwarmView:
        reads.append(1)
        return views[min(len(reads) + 1, len(views) - 1)]

    ctx = context(run)
    ctx.current_view = lambda: views.pop(0) if len(views) > 1 else views[0]
    ctx.read_view = read_view
    waits: list[float] = []

    def first_replica(view: SwarmView) -> str | None:
        replicas = view.replicas(1)
        return replicas[0].peer_id if replicas else None

    async def main() -> None:
        found = await ctx.wait_for(first_replica, 5.0, poll_s=0.01, while_waiting=lambda v, s: waits.append(s))
        assert found == "QmReplica" and len(waits) == 2  # no view, then a view without one: two more looks
        assert await ctx.wait_for(lambda view: None, 0.05, poll_s=0.01) is None
        assert await ctx.wait_for(first_replica, 1.0, poll_s=0.01, fresh=True) == "QmReplica" and reads

    asyncio.run(main())


def _view_of(run, *nodes: NodeInfo) -> SwarmView:
    return SwarmView(run.run_id, 3, (0, 2, 2), nodes=nodes, taken_at=0.0)


def test_a_data_node_routes_around_banned_peers_but_never_through_excluded_ones_and_swaps_a_share() -> None:
    """DataRoutes: a ban is a preference (the only replica left is still used), an exclusion is not;
    CheckFree+ visits the edge block stages swapped for its share of the microbatches."""
    from shoal.node.pipeline.data.routes import DataRoutes
    from shoal.planning.peer_router import Snapshot

    run = tiny_run(**{"repair.rule": "checkfree_plus"})
    ctx = context(run, dataclasses.replace(NodeConfig(), limits=LimitOptions(stage_wait_s=0.05)))
    data = NodeInfo(PEER, "data", 0, "active", 1.0, 4)
    one, two = NodeInfo("QmOne", "worker", 1, "active", 1.0, 4), NodeInfo("QmTwo", "worker", 2, "active", 1.0, 4)
    view = _view_of(run, data, one, two)
    ctx.current_view = lambda: view
    ctx.router.update(Snapshot(view, PEER))
    banned: set[str] = set()
    excluded: set[str] = set()
    routes = DataRoutes(ctx, lambda: banned | excluded, lambda: excluded)

    async def main() -> None:
        routed = await routes.next()
        assert routed is not None and routed.hops == ((1, "QmOne"), (2, "QmTwo"))
        ctx.router.end(routed)
        banned.add("QmOne")  # just failed us, but the only replica of stage 1: still routed to
        routed = await routes.next()
        assert routed is not None and routed.hops == ((1, "QmOne"), (2, "QmTwo"))
        ctx.router.end(routed)
        excluded.add("QmOne")  # excluded by audits: no route at all, once the stage wait is over
        assert await routes.next() is None

    asyncio.run(main())
    straight = ctx.router.route(PEER)
    shapes = {routes.swapped_for(straight, step, i).hops for step in range(4) for i in range(4)}
    assert shapes == {((1, "QmOne"), (2, "QmTwo")), ((2, "QmTwo"), (1, "QmOne"))}
    assert 0 < routes.swapped < 16


def test_a_data_node_says_which_stages_it_waits_for_and_which_were_rebuilt(tmp_path) -> None:
    """StageWatch and the progress file: a stage without a replica is reported once per report
    interval (and kept for the node record), a worker's repair is written once, at the current step."""
    import json

    from shoal.node.pipeline.data.ledger import MicrobatchLedger
    from shoal.node.pipeline.data.progress import ProgressFile, StageWatch
    from shoal.planning.swarm_view import RepairNote

    run = tiny_run()
    ctx = context(run)
    path = tmp_path / "progress.jsonl"
    rebuilt = NodeInfo("QmTwo", "worker", 2, "active", 1.0, 4, repair=RepairNote(2, "checkfree", (1,), 7, 0.5, 42.0))
    views = [_view_of(run, NodeInfo(PEER, "data", 0, "active", 1.0, 4), rebuilt)]
    ctx.current_view = lambda: views[-1]
    watch = StageWatch(ctx, ProgressFile(str(path)), MicrobatchLedger())
    finished = asyncio.Event()

    async def main() -> None:
        task = asyncio.create_task(watch.run(finished, lambda: 5))
        await asyncio.sleep(0.05)
        assert watch.waiting_for == [1]
        await asyncio.sleep(0.6)  # several looks: one report, one repair event
        finished.set()
        await task

    asyncio.run(main())
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["waiting", "repair"]
    assert events[0]["stages"] == [1] and events[0]["ledger"]["microbatches_in_flight"] == 0
    assert events[1]["step"] == 5 and events[1]["rule"] == "checkfree" and events[1]["sources"] == [1]


def test_a_worker_still_computing_a_forward_takes_its_data_nodes_resume_for_when_it_is_done() -> None:
    """A hop after ours was lost before the activation got there: the data node's resume is taken by
    the hop that still computes it (it keeps no output yet), checked as a resume of kept output is, and
    the forward then leaves along the new route; a resume from anyone else, or through other stages,
    is refused and changes nothing."""

    async def main() -> None:
        worker = StageWorker(context(tiny_run(**{"model.n_layers": 3, "pipeline.stages": 4})), 1)  # stages 1..3
        origin, lost, spare, last = "QmOrigin", "QmLostReplica", "QmSpareReplica", "QmLastStage"
        sent = ForwardRequest(
            microbatch_id="m1", origin=origin, step=0, hop=0, route=(Hop(1, PEER), Hop(2, lost), Hop(3, last))
        )
        worker.forwarder.computing["m1"] = sent
        new_route = (Hop(1, PEER), Hop(2, spare), Hop(3, last))
        try:
            for sender, route in (
                ("QmStranger", new_route),
                (origin, (Hop(1, PEER), Hop(3, spare), Hop(3, last))),
                (origin, (Hop(1, "QmSomeoneElse"), Hop(2, spare), Hop(3, last))),
            ):
                ack = await worker.redo.on_resume_forward(ResumeForward(microbatch_id="m1", hop=0, route=route), sender)
                assert not ack.accepted and "m1" not in worker.forwarder.resumed_routes
            ack = await worker.redo.on_resume_forward(ResumeForward(microbatch_id="m1", hop=0, route=new_route), origin)
            assert ack.accepted and worker.forwarder.resumed_routes["m1"] == new_route and worker.redo.resumed == 1
            ack = await worker.redo.on_resume_forward(ResumeForward(microbatch_id="m2", hop=0, route=new_route), origin)
            assert not ack.accepted  # neither computing nor kept
        finally:
            await worker.stop()

    asyncio.run(main())


def test_under_gwtf_a_worker_answers_a_forward_with_its_load_and_onward_cost() -> None:
    async def main() -> None:
        run = tiny_run()
        worker = StageWorker(context(run), 1)
        try:
            assert worker.forwarder.taken(DATA).load is None  # no view yet: nothing to say beyond the accept
            view = SwarmView(
                run.run_id,
                run.pipeline.stages,
                tuple(0 if s == 0 else 1 for s in range(run.pipeline.stages)),
                tuple(
                    NodeInfo(peer, "data" if stage == 0 else "worker", stage, "active", 50.0, 4)
                    for stage, peer in enumerate(
                        [DATA, PEER, *(f"QmStage{s}{'0' * 39}" for s in range(2, run.pipeline.stages))]
                    )
                ),
            )
            worker.ctx.router.update(Snapshot(view, PEER))
            worker.forwarder.forwarding.update({"a", "b"})
            ack = worker.forwarder.taken(DATA)
            assert ack.accepted and ack.load == 2 and ack.onward_s is not None and ack.onward_s > 0
        finally:
            await worker.stop()

    asyncio.run(main())


def test_every_role_a_node_takes_has_its_engine_factory():
    from shoal.node.config import ROLES
    from shoal.node.engines import ENGINES

    assert set(ENGINES) == set(ROLES) - {"auto"}
    assert {role: factory.work for role, factory in ENGINES.items()} == {
        "data": "train",  # a data node drives the training
        "worker": None,  # a stage worker only answers its peers
        "rollout": "rounds",
    }
