"""What one simulated run reports, and the readable table `shoal sim` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SimResult:
    policy: str
    nodes: int
    stages: int
    makespan_s: float  # first injection to the last microbatch completed or abandoned
    throughput_mb_per_s: float  # completed microbatches / makespan
    injected: int
    completed: int
    abandoned: int
    abandoned_reasons: dict[str, int]
    recomputed_hops: int  # stage computations done again after a loss
    restarted: int  # microbatches restarted from their data node (a lost hop whose re-sendable gradient died too)
    wasted_compute_s: float  # compute whose result was lost (crashed work, recomputed or restarted hops)
    busy_s: float  # compute seconds, summed over nodes
    idle_s: float  # live node-seconds without compute inside the makespan, summed over nodes
    idle_fraction: float
    collision_s: float  # seconds tasks were ready but their node was computing another microbatch
    memory_wait_s: float  # seconds activations waited at a node with no free memory
    planned_wait_s: float  # seconds tasks waited for their planned start (collision-aware plans)
    scheduler_wall_s: float  # wall-clock seconds spent inside planning/ for this run
    predicted_makespan_s: float | None  # the plan's own timetable, when it made one
    collisions: int = 0  # tasks on block-stage nodes that waited while their node computed another
    churn: dict[str, int] = field(default_factory=dict)
    scheduler_wall_by_call: dict[str, float] = field(default_factory=dict)  # e.g. allocate_stages, plan_skippipe

    def to_dict(self) -> dict:
        return asdict(self)


_ROWS = (
    ("makespan_s", "iteration time / time to N (s)", "{:.2f}"),
    ("throughput_mb_per_s", "throughput (microbatches/s)", "{:.4f}"),
    ("injected", "injected", "{}"),
    ("completed", "completed", "{}"),
    ("abandoned", "abandoned", "{}"),
    ("recomputed_hops", "recomputed hops", "{}"),
    ("restarted", "restarted microbatches", "{}"),
    ("wasted_compute_s", "wasted compute (s)", "{:.2f}"),
    ("idle_fraction", "idle share of node time", "{:.3f}"),
    ("idle_s", "idle node-seconds", "{:.1f}"),
    ("collision_s", "collision wait (s)", "{:.2f}"),
    ("memory_wait_s", "memory wait (s)", "{:.2f}"),
    ("planned_wait_s", "planned wait (s)", "{:.2f}"),
    ("scheduler_wall_s", "planner wall time (s)", "{:.4f}"),
    ("predicted_makespan_s", "planner's predicted makespan (s)", "{:.2f}"),
)


def format_table(result: SimResult) -> str:
    lines = [f"policy {result.policy}: {result.nodes} nodes, {result.stages} stages"]
    width = max(len(label) for _, label, _ in _ROWS)
    for key, label, fmt in _ROWS:
        value = getattr(result, key)
        lines.append(f"  {label:<{width}}  {'-' if value is None else fmt.format(value)}")
    if result.abandoned_reasons:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(result.abandoned_reasons.items()))
        lines.append(f"  {'abandoned because':<{width}}  {reasons}")
    if result.churn:
        lines.append(f"  {'churn':<{width}}  " + ", ".join(f"{k} {v}" for k, v in sorted(result.churn.items())))
    return "\n".join(lines)
