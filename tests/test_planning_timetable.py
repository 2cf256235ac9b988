"""SkipPipe's shared timetable: every data node computes the same collision-free plan for the step."""

from __future__ import annotations

import random

import pytest

from shoal.planning.costs import CostModel
from shoal.planning.plan import IterationPlan
from shoal.planning.skippipe import SkipPipeOptions, plan_skippipe
from shoal.planning.swarm_view import NodeInfo, SwarmView
from shoal.planning.timetable import binned, full_pass_step, reads_swarm, step_timetable
from shoal.sim.replay import releases_only, simulate_plan

COST = CostModel(activation_bytes=256 * 1024)
OPTIONS = SkipPipeOptions(skip=0.33, max_jump=3, search_budget=16)
DATA = ("data-a", "data-b")
WORKERS = tuple(f"w{stage}{replica}" for stage in (1, 2, 3) for replica in "xy")


def _node(peer: str, stage: int, state: str = "active") -> NodeInfo:
    links = tuple((other, 0.002, 50e6) for other in (*DATA, *WORKERS) if other != peer)
    return NodeInfo(peer, "data" if stage == 0 else "worker", stage, state, 10.0, 4, links=links)


def _view(*extra: NodeInfo, reverse: bool = False) -> SwarmView:
    nodes = [_node(d, 0) for d in DATA] + [_node(w, int(w[1])) for w in WORKERS] + list(extra)
    return SwarmView("run", 4, (0, 1, 1, 1), tuple(reversed(nodes) if reverse else nodes))


def _plan(view: SwarmView, step: int = 5, exclude=()):
    timetable = step_timetable(view, COST, "run", step, 4, OPTIONS, exclude=exclude)
    assert timetable is not None
    return timetable


def test_every_data_node_computes_the_same_plan_and_takes_its_own_share_of_it():
    mine, theirs = _plan(_view()), _plan(_view(reverse=True))  # the view in another order: the same plan
    assert mine.digest == theirs.digest
    for data in DATA:
        paths = mine.paths_of(data)
        assert len(paths) == 4
        assert [p.release_s for p in paths] == sorted(p.release_s for p in paths)
        assert min(p.release_s for p in paths) >= 0.0
        for path in paths:
            assert len(path.hops) == 2  # a third of 3 block stages skipped
            assert all(peer in WORKERS and int(peer[1]) == stage for stage, peer in path.hops)
    assert min(p.release_s for d in DATA for p in mine.paths_of(d)) == 0.0


def test_the_timetable_books_no_two_microbatches_on_one_worker_at_once():
    timetable = _plan(_view())
    plan, swarm = timetable.plan, timetable.swarm
    busy: dict[int, list[tuple[float, float]]] = {}
    for route, timing in zip(plan.routes, plan.timings, strict=True):
        for hop, forward, backward in zip(route.hops, timing.forward_s, timing.backward_s, strict=True):
            node = swarm.node(hop)
            busy.setdefault(hop, []).append((forward, forward + node.forward_s))
            busy.setdefault(hop, []).append((backward, backward + node.forward_s * COST.backward_factor))
    for intervals in busy.values():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end - 1e-9


def test_joining_and_excluded_peers_get_no_path_and_a_stage_with_nobody_gets_no_plan():
    joining = NodeInfo("w1z", "worker", 1, "joining", 10.0, 4)
    timetable = _plan(_view(joining), exclude={"w2x"})
    used = {peer for d in DATA for p in timetable.paths_of(d) for _, peer in p.hops}
    assert "w1z" not in used and "w2x" not in used
    assert step_timetable(_view(), COST, "run", 0, 4, OPTIONS, exclude={"w3x", "w3y"}) is None
    # a joining data node is planned for: it sees its own record active before the others see it so
    newcomer = NodeInfo("data-c", "data", 0, "joining", 10.0, 4)
    assert len(_plan(_view(newcomer)).paths_of("data-c")) == 4


def test_the_full_pass_is_every_nth_step_counted_from_one():
    assert [s for s in range(30) if full_pass_step(s, 10)] == [9, 19, 29]
    assert not any(full_pass_step(s, 0) for s in range(30))
    assert [s for s in range(30) if reads_swarm(s, 10)] == [0, 10, 20]  # the first step and after each full pass
    assert [s for s in range(30) if reads_swarm(s, 0)] == [0, 10, 20]


def test_the_simulator_replays_the_timetable_without_collisions_and_plans_made_alone_with_them():
    timetable = _plan(_view())
    assert simulate_plan(timetable.plan, COST).collisions == 0
    swarm, routes = timetable.swarm, []
    for data in swarm.data_nodes:  # each data node plans as if it were the only one
        mine = swarm.with_nodes(tuple(n for n in swarm.nodes if n.stage > 0 or n.node_id == data.node_id))
        routes += plan_skippipe(mine, COST, 4, OPTIONS, random.Random(data.node_id)).routes
    alone = simulate_plan(IterationPlan("alone", swarm, tuple(routes)), COST)
    assert alone.completed == 8 and alone.collisions > 0
    released = simulate_plan(releases_only(timetable.plan), COST)  # hops in arrival order, not at their times
    assert released.completed == 8


def test_figures_a_few_percent_apart_plan_alike_and_every_hop_gets_its_planned_starts():
    assert [binned(x) for x in (0.0, 1.0, 1.3, 1.5, 3.9, 0.001)] == [0.0, 1.0, 1.0, 2.0, 4.0, 2.0**-10]
    assert [binned(x, 10.0) for x in (0.002, 0.03, 0.04, 5e7)] == pytest.approx([1e-3, 1e-2, 1e-1, 1e8])
    base = _view()
    nudged = base.with_throughput({n.peer_id: n.block_throughput * 1.04 for n in base.nodes})
    assert _plan(nudged).digest == _plan(base).digest
    for path in _plan(base).paths_of("data-a"):
        assert len(path.forward_s) == len(path.backward_s) == len(path.hops)
        assert path.release_s <= path.forward_s[0] <= path.forward_s[-1] <= path.backward_s[-1] <= path.backward_s[0]
