"""Scenarios as data: a network of regions plus the compute and size constants of one experiment.

`gcp12` ships as package data (`shoal/sim/scenarios/gcp12.json`), a byte-for-byte copy of the
project's shared scenario file, whose figures come from the SkipPipe authors' scheduler
(gensyn-ai/skippipe, schedulers/communication_costs.py; see the file's own "source" field): one-way
latency and bandwidth between 12 GCP regions, 0.055 s of forward per layer per sample, 32 MiB
activations, 3 microbatches of memory, 0.35 s of overhead per hop, and the paper's 20-node
setting. Any JSON file in the same format can be passed instead of a name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from shoal.errors import UsageError
from shoal.planning.costs import CostModel
from shoal.planning.swarm import PlanNode, Swarm

GIB = 1024**3


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str
    regions: tuple[str, ...]
    latency_s: tuple[tuple[float, ...], ...]
    bandwidth_Bps: tuple[tuple[float, ...], ...]
    forward_s_per_layer_sample: float
    backward_factor: float
    head_factor: float
    per_hop_overhead_s: float
    layers: int
    samples_per_microbatch: int
    activation_bytes: int
    memory: int
    nodes: int
    stages: int
    nodes_per_stage: tuple[int, ...]
    microbatches: int
    skip: float
    max_swaps: int

    def cost_model(self) -> CostModel:
        return CostModel(
            activation_bytes=self.activation_bytes,
            per_hop_overhead_s=self.per_hop_overhead_s,
            backward_factor=self.backward_factor,
            head_factor=self.head_factor,
        )

    def stage_forward_s(self, stages: int) -> float:
        """Forward of one stage for one microbatch when the layers are split over `stages` stages."""
        return self.forward_s_per_layer_sample * (self.layers / stages) * self.samples_per_microbatch

    def with_bandwidth(self, a: str, b: str, bandwidth_GiBps: float) -> Scenario:
        """The same scenario with one (symmetric) link's bandwidth replaced."""
        i, j = self.regions.index(a), self.regions.index(b)
        rows = [list(r) for r in self.bandwidth_Bps]
        rows[i][j] = rows[j][i] = bandwidth_GiBps * GIB
        return replace(self, bandwidth_Bps=tuple(tuple(r) for r in rows))


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name (`gcp12`) or a JSON file in the same format."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UsageError(f"scenario file {name_or_path} does not exist")
        text = path.read_text()
    else:
        try:
            text = resources.files("shoal.sim").joinpath(f"scenarios/{name_or_path}.json").read_text()
        except FileNotFoundError:
            raise UsageError(
                f"unknown scenario {name_or_path!r}: give a bundled name (gcp12) or a .json file"
            ) from None
    try:
        return scenario_from_dict(json.loads(text))
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"scenario {name_or_path}: malformed ({e})") from None


def scenario_from_dict(data: dict) -> Scenario:
    regions = tuple(data["regions"])
    index = {r: i for i, r in enumerate(regions)}
    same = data["same_region_link"]
    lat = [[float("nan")] * len(regions) for _ in regions]
    bw = [[float("nan")] * len(regions) for _ in regions]
    for i in range(len(regions)):
        lat[i][i], bw[i][i] = same["latency_ms"] / 1000.0, same["bandwidth_GiBps"] * GIB
    for link in data["links"]:
        i, j = index[link["a"]], index[link["b"]]
        lat[i][j] = lat[j][i] = link["latency_ms"] / 1000.0
        bw[i][j] = bw[j][i] = link["bandwidth_GiBps"] * GIB
    if any(math.isnan(v) for row in lat for v in row):
        raise ValueError("the links do not cover every pair of regions")
    compute, paper = data["compute"], data["paper_setting"]
    return Scenario(
        name=data["name"],
        source=data.get("source", ""),
        regions=regions,
        latency_s=tuple(tuple(r) for r in lat),
        bandwidth_Bps=tuple(tuple(r) for r in bw),
        forward_s_per_layer_sample=float(compute["forward_s_per_sample_per_layer"]),
        backward_factor=float(compute["backward_factor"]),
        head_factor=float(compute["loss_and_head_factor"]),
        per_hop_overhead_s=float(data["per_hop_overhead_s"]),
        layers=int(paper["layers"]),
        samples_per_microbatch=int(paper["samples_per_microbatch"]),
        activation_bytes=int(paper["activation_bytes_per_microbatch"]),
        memory=int(paper["memory_microbatches_per_node"]),
        nodes=int(paper["nodes"]),
        stages=int(paper["stages"]),
        nodes_per_stage=tuple(int(x) for x in paper["nodes_per_stage"]),
        microbatches=int(paper["microbatches_per_iteration"]),
        skip=float(paper["skip_ratio"]),
        max_swaps=int(paper["max_adjacent_swaps"]),
    )


def stage_sizes(scenario: Scenario, nodes: int, stages: int) -> tuple[int, ...]:
    """Nodes per stage: the paper's split at its own setting, else a quarter (at least one) as data
    nodes and the rest spread evenly over the block stages (20 nodes, 6 stages gives the paper's)."""
    if (nodes, stages) == (scenario.nodes, scenario.stages):
        return scenario.nodes_per_stage
    data = max(1, math.ceil(nodes / 4))
    if nodes - data < stages - 1:
        raise UsageError(f"{nodes} nodes cannot fill {stages} stages (need {stages - 1} block nodes + data nodes)")
    base, extra = divmod(nodes - data, stages - 1)
    return (data,) + tuple(base + (1 if s < extra else 0) for s in range(stages - 1))


def scenario_swarm(scenario: Scenario, nodes: int | None = None, stages: int | None = None) -> Swarm:
    """The scenario's homogeneous swarm: node i in region i mod R (round-robin, as the authors placed
    them), stages filled in id order; a planner may re-allocate them."""
    nodes = scenario.nodes if nodes is None else nodes
    stages = scenario.stages if stages is None else stages
    sizes = stage_sizes(scenario, nodes, stages)
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    forward = scenario.stage_forward_s(stages)
    members = tuple(PlanNode(i, stage_of[i], i % len(scenario.regions), forward, scenario.memory) for i in range(nodes))
    return Swarm(members, stages, scenario.latency_s, scenario.bandwidth_Bps, scenario.regions)
