"""SkipPipe's path rules: how many stages a partial path visits, in which orders, and how often each.

These rules are what keeps skip-training convergent (every stage sees the same share of the data,
no stage twice in one pass, reorderings only between neighbours), so planners build paths under
them and tests check every plan against `path_violation`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shoal.planning.plan import IterationPlan


def block_visits(stages: int, skip: float) -> int:
    """Block stages a path visits: (1 - skip) * (S - 1), rounded half up, at least one.

    At the paper's setting (S = 6, skip = 0.33) this is 3 of 5, as in the authors' code.
    """
    if stages < 2:
        raise ValueError("a pipeline needs a data stage and at least one block stage")
    if not 0.0 <= skip < 1.0:
        raise ValueError(f"skip ratio must be in [0, 1), got {skip}")
    return max(1, min(stages - 1, int((1.0 - skip) * (stages - 1) + 0.5)))


def swap_count(stage_seq: Sequence[int]) -> int | None:
    """Adjacent swaps that turn the ascending order into `stage_seq`; None if it is not such a path.

    Allowed: neighbours in the path whose stages differ by exactly one, exchanged (..., 4, 3, ...).
    Any other inversion (a jump backwards, or a swap of non-adjacent stages) is not allowed.
    """
    swaps = 0
    for i in range(len(stage_seq)):
        for j in range(i + 1, len(stage_seq)):
            if stage_seq[i] > stage_seq[j]:
                if j != i + 1 or stage_seq[i] != stage_seq[j] + 1:
                    return None
                swaps += 1
    return swaps


def visit_quotas(n_routes: int, stages: int, visits: int) -> list[int]:
    """Visits each block stage receives over one iteration: equal, the remainder to the lowest stages.

    Index 0 (the data stage) is always 0: every path visits its own data node by construction.
    """
    total = n_routes * visits
    base, extra = divmod(total, stages - 1)
    return [0] + [base + (1 if s <= extra else 0) for s in range(1, stages)]


def path_violation(stage_seq: Sequence[int], stages: int, visits: int, max_swaps: int) -> str | None:
    """Why a path's block-stage sequence breaks the rules, or None when it is valid."""
    if len(stage_seq) != visits:
        return f"visits {len(stage_seq)} block stages, expected {visits}"
    if len(set(stage_seq)) != len(stage_seq):
        return f"revisits a stage: {tuple(stage_seq)}"
    if any(not 1 <= s < stages for s in stage_seq):
        return f"visits a stage outside 1..{stages - 1}: {tuple(stage_seq)}"
    swaps = swap_count(stage_seq)
    if swaps is None:
        return f"order {tuple(stage_seq)} is not ascending up to adjacent swaps"
    if swaps > max_swaps:
        return f"uses {swaps} swaps, at most {max_swaps} allowed"
    return None


def plan_violations(plan: IterationPlan, visits: int, max_swaps: int) -> list[str]:
    """Every rule a skip plan breaks: per-path rules, origins, and equal visits per stage."""
    swarm = plan.swarm
    problems: list[str] = []
    counts: Counter[int] = Counter()
    for i, route in enumerate(plan.routes):
        if swarm.node(route.origin).stage != 0:
            problems.append(f"route {i} starts at {route.origin}, which is not a data node")
        seq = route.stages(swarm)
        why = path_violation(seq, swarm.stages, visits, max_swaps)
        if why:
            problems.append(f"route {i}: {why}")
        counts.update(seq)
    want = visit_quotas(len(plan.routes), swarm.stages, visits)
    if sorted(counts[s] for s in range(1, swarm.stages)) != sorted(want[1:]):
        problems.append(f"unequal stage visits {dict(sorted(counts.items()))}, expected {want[1:]}")
    return problems


def stage_moves(
    frontier: int,
    pending: int | None,
    swaps: int,
    left: int,
    quota: Sequence[int],
    remaining: int,
    max_jump: int | None,
    max_swaps: int,
) -> list[tuple[int, int, int | None, int]]:
    """Legal next block stages for a partial path: (stage, new frontier, pending stage, swaps used).

    `frontier` is the highest stage visited so far (0 at the data node); `left` the block visits
    still to make; `quota` the visits each stage still needs over the `remaining` paths (including
    this one). A stage whose quota equals `remaining` must be on this path, so no move may jump past
    it, and no move may leave too few stages above it to finish. A swap visits t+1 then t and
    leaves t `pending` for the next move.
    """
    if pending is not None:
        return [(pending, frontier, None, swaps)]
    stages = len(quota)
    top = stages - 1 if max_jump is None else min(stages - 1, frontier + max_jump)
    mandatory = [s for s in range(1, stages) if quota[s] >= remaining and quota[s] > 0]
    open_above = [s for s in range(1, stages) if quota[s] > 0]

    def finishable(last: int, still: int) -> bool:
        above = sum(1 for s in open_above if s > last)
        needed = sum(1 for m in mandatory if m > last)
        return above >= still and needed <= still

    moves: list[tuple[int, int, int | None, int]] = []
    for t in range(frontier + 1, top + 1):
        if quota[t] <= 0:
            continue
        if any(frontier < m < t for m in mandatory):
            break  # every later t would skip this mandatory stage too
        if finishable(t, left - 1):
            moves.append((t, t, None, swaps))
        if swaps < max_swaps and left >= 2 and t + 1 <= top and quota[t + 1] > 0 and finishable(t + 1, left - 2):
            moves.append((t + 1, t + 1, t, swaps + 1))
    return moves
