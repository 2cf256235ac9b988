from __future__ import annotations

from shoal.planning.assignment import Candidate, choose_stage
from shoal.planning.swarm_view import NodeInfo, SwarmView


def _node(peer: str, stage: int, throughput: float = 10.0, started: float = 0.0, state: str = "active") -> NodeInfo:
    return NodeInfo(
        peer_id=peer,
        role="data" if stage == 0 else "worker",
        stage=stage,
        state=state,
        block_throughput=throughput,
        max_inflight=8,
        started_at=started,
    )


def _view(*nodes: NodeInfo, stages: int = 4) -> SwarmView:
    return SwarmView("run", stages, (0,) + (2,) * (stages - 1), tuple(nodes))


def _me(
    peer: str = "me", throughput: float = 10.0, started: float = 100.0, role: str = "auto", current: int | None = None
) -> Candidate:
    return Candidate(peer, throughput, started, role, current)


def test_first_node_becomes_the_data_node_unless_told_otherwise():
    assert choose_stage(_view(), _me()) == 0
    assert choose_stage(_view(), _me(role="worker")) in (1, 2, 3)
    assert choose_stage(_view(_node("d", 0)), _me(role="data")) == 0


def test_empty_stages_are_filled_first():
    view = _view(_node("d", 0), _node("a", 1), _node("b", 1), _node("c", 3))
    assert choose_stage(view, _me()) == 2


def test_then_the_bottleneck_stage_is_strengthened():
    view = _view(_node("d", 0), _node("a", 1, 30), _node("b", 2, 5), _node("c", 3, 30))
    assert choose_stage(view, _me()) == 2


def test_leaving_nodes_do_not_count():
    view = _view(_node("d", 0), _node("a", 1), _node("b", 2, state="leaving"), _node("c", 3))
    assert choose_stage(view, _me()) == 2


def test_simultaneous_claims_resolve_by_seniority():
    # Two auto nodes both claimed stage 0: the senior keeps it, the junior becomes a worker.
    view = _view(_node("old", 0, started=1.0), _node("new", 0, started=2.0))
    assert choose_stage(view, _me("old", started=1.0, current=0)) == 0
    assert choose_stage(view, _me("new", started=2.0, current=0)) != 0
    # Two workers on stage 1 while stage 2 is empty: only the junior moves.
    view = _view(_node("d", 0), _node("a", 1, started=1.0), _node("b", 1, started=2.0), _node("c", 3), stages=4)
    assert choose_stage(view, _me("a", started=1.0, current=1)) == 1
    assert choose_stage(view, _me("b", started=2.0, current=1)) == 2


def test_hysteresis_keeps_a_node_unless_the_gain_is_clear():
    base = [_node("d", 0), _node("a", 1, 10), _node("c", 3, 10)]
    # me on stage 2 with a peer; stage 1 slightly weaker than stage 2 would be without me: stay.
    view = _view(*base, _node("b", 2, 9), _node("me", 2, 10))
    assert choose_stage(view, _me(current=2)) == 2
    # stage 1 far weaker: moving there clearly raises the bottleneck.
    view = _view(_node("d", 0), _node("a", 1, 1), _node("c", 3, 40), _node("b", 2, 40), _node("me", 2, 40))
    assert choose_stage(view, _me(throughput=40, current=2)) == 1


def test_sole_holder_never_leaves_its_stage():
    view = _view(_node("d", 0), _node("a", 1, 1), _node("me", 2, 40), _node("c", 3, 40))
    assert choose_stage(view, _me(throughput=40, current=2)) == 2


def test_nodes_that_see_the_same_view_do_not_all_move_at_once():
    # A senior and three juniors on stage 1, stage 2 empty: one junior (the most junior) fills it.
    view = _view(_node("d", 0), _node("s", 1, started=1.0), *[_node(f"j{i}", 1, started=2.0 + i) for i in range(3)],
                 stages=3)  # fmt: skip
    moves = {f"j{i}": choose_stage(view, _me(f"j{i}", started=2.0 + i, current=1)) for i in range(3)}
    assert moves == {"j0": 1, "j1": 1, "j2": 2}
    # Three on stage 2 and one on stage 1: only the most junior of stage 2 moves for throughput.
    view = _view(_node("d", 0), _node("s", 1, started=1.0), *[_node(f"j{i}", 2, started=2.0 + i) for i in range(3)],
                 stages=3)  # fmt: skip
    moves = {f"j{i}": choose_stage(view, _me(f"j{i}", started=2.0 + i, current=2)) for i in range(3)}
    assert moves == {"j0": 2, "j1": 2, "j2": 1}


def test_a_node_takes_only_a_stage_its_memory_holds():
    """The data role, an empty stage and the bottleneck are all passed over when they do not fit."""
    blocks_only = Candidate("me", 10.0, 100.0, stages_that_fit=frozenset({1, 2, 3}))
    assert choose_stage(_view(), blocks_only) in (1, 2, 3)  # no data node yet, but stage 0 does not fit
    view = _view(_node("d", 0), _node("a", 1), _node("c", 3))
    assert choose_stage(view, _me()) == 2
    assert choose_stage(view, Candidate("me", 10.0, 100.0, stages_that_fit=frozenset({1, 3}))) in (1, 3)
    bottleneck = _view(_node("d", 0), _node("a", 1, 30), _node("b", 2, 5), _node("c", 3, 30))
    assert choose_stage(bottleneck, Candidate("me", 10.0, 100.0, stages_that_fit=frozenset({0, 1, 3}))) in (1, 3)
    # holding a stage that no longer fits (a smaller --memory-limit after a restart): it moves
    assert choose_stage(bottleneck, Candidate("me", 10.0, 100.0, "auto", 2, frozenset({1, 3}))) in (1, 3)
    # only stage 0 fits: one more data node, even where the swarm has one
    assert choose_stage(view, Candidate("me", 10.0, 100.0, stages_that_fit=frozenset({0}))) == 0


def test_joiners_that_see_each_other_copy_from_different_donors():
    from shoal.planning.donors import donor_order

    donors = [_node("d1", 1), _node("d2", 1), _node("old", 1)]
    donors = [NodeInfo(**{**n.__dict__, "inner_step": step}) for n, step in zip(donors, (40, 41, 12), strict=True)]
    a = _node("joiner-a", 1, started=5.0, state="joining")
    b = _node("joiner-b", 1, started=7.0, state="joining")
    first, second = donor_order("joiner-a", 5.0, donors, [b]), donor_order("joiner-b", 7.0, donors, [a])
    assert first[0] != second[0] and {first[0], second[0]} == {"d1", "d2"}
    assert first[-1] == second[-1] == "old"  # far behind the others: tried last, by everyone
    assert sorted(first) == sorted(second) == ["d1", "d2", "old"]
    assert donor_order("alone", 1.0, donors, [])[:2] in (["d1", "d2"], ["d2", "d1"])
    assert donor_order("alone", 1.0, [], [a]) == []
