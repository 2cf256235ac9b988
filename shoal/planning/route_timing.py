"""A timetable for routes already chosen: every task booked into its node's timeline, in release order.

The group-path search (`group_paths.py`) scores each candidate set of paths with this: the same
booking rules as the per-microbatch planner in `skippipe.py` (a task waits for a free slot, an
activation waits for memory, a residency lasts until that microbatch's backward there), so a plan
timed here is realised exactly by the simulator and never overlaps two tasks or overfills a node.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from shoal.planning.costs import CostModel
from shoal.planning.plan import IterationPlan, Route, Timing
from shoal.planning.swarm import NodeId, Swarm
from shoal.planning.timeline import Timeline


def time_routes(
    swarm: Swarm,
    cost: CostModel,
    paths: Mapping[NodeId, Sequence[tuple[NodeId, ...]]],
    counts: Mapping[NodeId, int],
    policy: str = "skippipe",
) -> IterationPlan:
    """Time `counts[o]` microbatches from each data node o, the j-th along `paths[o][j % len(paths[o])]`.

    Microbatches are booked in the order their data nodes can release them (the earliest first; among
    equals, the data node with the fewest booked), which staggers the data nodes' releases by itself.
    """
    timelines: dict[NodeId, Timeline] = {}

    def tl(node_id: NodeId) -> Timeline:
        line = timelines.get(node_id)
        if line is None:
            line = timelines[node_id] = Timeline()
        return line

    nodes = swarm.by_id
    booked = dict.fromkeys(counts, 0)
    ready = [(0.0, 0, o) for o in sorted(counts) if counts[o] > 0]
    heapq.heapify(ready)
    routes: list[Route] = []
    timings: list[Timing] = []
    while ready:
        floor, _, origin_id = heapq.heappop(ready)
        origin = nodes[origin_id]
        hops = paths[origin_id][booked[origin_id] % len(paths[origin_id])]
        line = tl(origin_id)
        release = line.earliest_slot(line.free_memory_from(floor, origin.memory), origin.forward_s)
        t, prev = release + origin.forward_s, origin
        forward: list[float] = []
        for h in hops:
            node = nodes[h]
            hop_line = tl(h)
            admit = hop_line.free_memory_from(t + cost.transfer_s(swarm, prev, node), node.memory)
            begin = hop_line.earliest_slot(admit, node.forward_s)
            forward.append(begin)
            t, prev = begin + node.forward_s, node
        head = line.earliest_slot(t + cost.transfer_s(swarm, prev, origin), cost.head_s(origin))
        t, prev = head + cost.head_s(origin), origin
        backward = [0.0] * len(hops)
        for i in reversed(range(len(hops))):
            node = nodes[hops[i]]
            backward[i] = tl(hops[i]).earliest_slot(t + cost.transfer_s(swarm, prev, node), cost.backward_s(node))
            t, prev = backward[i] + cost.backward_s(node), node
        origin_bwd = line.earliest_slot(t + cost.transfer_s(swarm, prev, origin), cost.backward_s(origin))
        end = origin_bwd + cost.backward_s(origin)
        line.book(release, origin.forward_s)
        line.book(head, cost.head_s(origin))
        line.book(origin_bwd, cost.backward_s(origin))
        line.hold(end)
        for h, f, b in zip(hops, forward, backward, strict=True):
            node = nodes[h]
            tl(h).book(f, node.forward_s)
            tl(h).book(b, cost.backward_s(node))
            tl(h).hold(b + cost.backward_s(node))
        routes.append(Route(origin_id, tuple(hops)))
        timings.append(Timing(release, tuple(forward), head, tuple(backward), origin_bwd, end))
        booked[origin_id] += 1
        if booked[origin_id] < counts[origin_id]:
            heapq.heappush(ready, (release, booked[origin_id], origin_id))
    return IterationPlan(policy, swarm, tuple(routes), tuple(timings))


def list_schedule_routes(
    swarm: Swarm,
    cost: CostModel,
    paths: Mapping[NodeId, Sequence[tuple[NodeId, ...]]],
    counts: Mapping[NodeId, int],
    policy: str = "skippipe",
) -> IterationPlan:
    """Time the same microbatches by running them: an event-driven list schedule where a free node
    takes a waiting backward (or loss) before any forward, forwards in arrival order, and an activation
    is admitted in arrival order once the node has memory. The start times it observes are the plan.

    Unlike `time_routes`, which books one whole microbatch after another, this can let a later
    microbatch's backward go ahead of an earlier one's forward: the order the authors' emulator (and
    an unplanned node) would use, which on a fixed path set is often the shorter makespan.
    """
    nodes = swarm.by_id
    # per microbatch: its origin, hops, and the task list [(node, kind, duration)] in execution order
    mbs: list[tuple[NodeId, tuple[NodeId, ...]]] = []
    for o in sorted(counts):
        for j in range(counts[o]):
            mbs.append((o, tuple(paths[o][j % len(paths[o])])))
    steps: list[list[tuple[NodeId, int, float]]] = []  # kind: 0 backward/head, 1 forward
    for o, hops in mbs:
        origin = nodes[o]
        seq = [(o, 1, origin.forward_s)] + [(h, 1, nodes[h].forward_s) for h in hops]
        seq.append((o, 0, cost.head_s(origin)))
        seq += [(h, 0, cost.backward_s(nodes[h])) for h in reversed(hops)]
        seq.append((o, 0, cost.backward_s(origin)))
        steps.append(seq)
    starts: list[list[float]] = [[0.0] * len(s) for s in steps]
    held = dict.fromkeys(nodes, 0)
    busy = dict.fromkeys(nodes, False)
    queue: dict[NodeId, list[tuple[int, float, int, int]]] = {n: [] for n in nodes}  # (kind, ready, seq, mb)
    waiting: dict[NodeId, list[tuple[float, int, int]]] = {n: [] for n in nodes}  # (arrived, seq, mb)
    pending: dict[NodeId, list[int]] = {o: [] for o in counts}
    for m, (o, _) in enumerate(mbs):
        pending[o].append(m)
    for o in pending:
        pending[o].reverse()  # pop() takes the next in order
    position = [0] * len(mbs)
    events: list[tuple[float, int, int, int]] = []  # (time, seq, what, mb): 0 arrival, 1 done
    counter = 0

    def push(t: float, what: int, m: int) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, what, m))

    def ready(t: float, m: int) -> None:
        nonlocal counter
        node, kind, _ = steps[m][position[m]]
        counter += 1
        heapq.heappush(queue[node], (kind, t, counter, m))

    def start_next(t: float, node_id: NodeId) -> None:
        if busy[node_id] or not queue[node_id]:
            return
        _, _, _, m = heapq.heappop(queue[node_id])
        busy[node_id] = True
        starts[m][position[m]] = t
        push(t + steps[m][position[m]][2], 1, m)

    def inject(t: float, o: NodeId) -> None:
        while pending[o] and held[o] < nodes[o].memory:
            m = pending[o].pop()
            held[o] += 1
            ready(t, m)
        start_next(t, o)

    for o in sorted(counts):
        inject(0.0, o)
    last_forward = [len(mbs[m][1]) for m in range(len(mbs))]  # index of the last hop's forward
    while events:
        t, _, what, m = heapq.heappop(events)
        node_id, kind, _ = steps[m][position[m]]
        if what == 0:  # arrival at steps[m][position[m]]
            if kind == 1:  # a forward at a block node needs memory first
                if held[node_id] < nodes[node_id].memory:
                    held[node_id] += 1
                    ready(t, m)
                else:
                    counter += 1
                    heapq.heappush(waiting[node_id], (t, counter, m))
            else:
                ready(t, m)
            start_next(t, node_id)
            continue
        busy[node_id] = False  # done
        freed = kind == 0 and position[m] > last_forward[m] + 1  # a backward: its residency ends here
        if freed:
            held[node_id] -= 1
            while waiting[node_id] and held[node_id] < nodes[node_id].memory:
                _, _, w = heapq.heappop(waiting[node_id])
                held[node_id] += 1
                ready(t, w)
        position[m] += 1
        if position[m] < len(steps[m]):
            nxt = steps[m][position[m]][0]
            push(t + cost.transfer_s(swarm, nodes[node_id], nodes[nxt]), 0, m)
        if freed and node_id == mbs[m][0]:
            inject(t, node_id)
        start_next(t, node_id)
    order = sorted(range(len(mbs)), key=lambda m: (starts[m][0], m))
    routes, timings = [], []
    for m in order:
        o, hops = mbs[m]
        s, k = starts[m], len(hops)
        end = s[-1] + steps[m][-1][2]
        routes.append(Route(o, hops))
        timings.append(Timing(s[0], tuple(s[1 : k + 1]), s[k + 1], tuple(reversed(s[k + 2 : 2 * k + 2])), s[-1], end))
    return IterationPlan(policy, swarm, tuple(routes), tuple(timings))
