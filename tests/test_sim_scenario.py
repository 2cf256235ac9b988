"""Scenarios as data: the bundled gcp12 copy, stage sizes, and the random swarm generator."""

from __future__ import annotations

import json
import random
from importlib import resources

import pytest

from shoal.errors import UsageError
from shoal.sim.generator import random_swarm
from shoal.sim.scenario import GIB, load_scenario, scenario_from_dict, scenario_swarm, stage_sizes


def test_gcp12_ships_as_package_data_with_its_source_and_the_papers_setting():
    text = resources.files("shoal.sim").joinpath("scenarios/gcp12.json").read_text()
    assert "gensyn-ai/skippipe" in json.loads(text)["source"]
    sc = load_scenario("gcp12")
    assert (sc.nodes, sc.stages, sc.nodes_per_stage, sc.microbatches) == (20, 6, (5, 3, 3, 3, 3, 3), 30)
    assert sc.stage_forward_s(6) == pytest.approx(0.055 * 4 * 8)  # 1.76 s, the authors' w
    b, n = sc.regions.index("Belgium"), sc.regions.index("NL")
    assert sc.latency_s[b][n] == pytest.approx(0.003) and sc.bandwidth_Bps[b][n] == pytest.approx(0.2425 * GIB)
    assert all(sc.latency_s[i][j] == sc.latency_s[j][i] for i in range(12) for j in range(12))
    assert sc.cost_model().per_hop_overhead_s == 0.35


def test_gcp12_swarm_places_nodes_round_robin_and_a_quarter_hold_data_elsewhere():
    sc = load_scenario("gcp12")
    swarm = scenario_swarm(sc)
    assert [n.site for n in swarm.nodes] == [i % 12 for i in range(20)]
    assert [len(g) for g in swarm.by_stage] == [5, 3, 3, 3, 3, 3]
    assert stage_sizes(sc, 100, 6) == (25, 15, 15, 15, 15, 15)
    assert stage_sizes(sc, 9, 4) == (3, 2, 2, 2)
    with pytest.raises(UsageError):
        stage_sizes(sc, 4, 6)


def test_the_nl_london_caveat_can_be_corrected_without_touching_the_file():
    sc = load_scenario("gcp12")
    fixed = sc.with_bandwidth("NL", "London", 0.2368)
    i, j = sc.regions.index("NL"), sc.regions.index("London")
    assert sc.bandwidth_Bps[i][j] == pytest.approx(0.00023681640625 * GIB)
    assert fixed.bandwidth_Bps[i][j] == fixed.bandwidth_Bps[j][i] == pytest.approx(0.2368 * GIB)


def test_a_scenario_file_missing_a_link_is_rejected():
    data = json.loads(resources.files("shoal.sim").joinpath("scenarios/gcp12.json").read_text())
    data["links"] = data["links"][1:]
    with pytest.raises(ValueError):
        scenario_from_dict(data)


def test_random_swarms_are_reproducible_heterogeneous_and_fill_every_stage():
    sc = load_scenario("gcp12")
    a = random_swarm(sc, 200, 8, random.Random(5))
    assert a == random_swarm(sc, 200, 8, random.Random(5))
    assert all(len(g) > 0 for g in a.by_stage)
    assert len({n.memory for n in a.nodes}) > 1 and len({round(n.forward_s, 3) for n in a.nodes}) > 100
    flat = random_swarm(sc, 50, 5, random.Random(5), heterogeneous=False)
    assert {n.forward_s for n in flat.nodes} == {sc.stage_forward_s(5)} and {n.memory for n in flat.nodes} == {3}
