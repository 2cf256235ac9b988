"""`shoal sim` as a user runs it: a table, JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
from importlib import resources

from shoal.cli import main


def test_sim_prints_a_table_and_json(capsys):
    assert main(["sim", "--scenario", "gcp12", "--policy", "skippipe", "--allocation", "given"]) == 0
    table = capsys.readouterr().out
    assert "policy skippipe: 20 nodes, 6 stages" in table and "planner wall time" in table
    args = [
        "sim",
        "--scenario",
        "random",
        "--nodes",
        "12",
        "--stages",
        "4",
        "--policy",
        "gwtf",
        "--churn",
        "20",
        "--seed",
        "3",
        "--microbatches",
        "20",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    for key in (
        "makespan_s",
        "throughput_mb_per_s",
        "idle_s",
        "collision_s",
        "completed",
        "abandoned",
        "recomputed_hops",
        "wasted_compute_s",
        "scheduler_wall_s",
    ):
        assert key in result
    assert result["completed"] == 20 and result["completed"] + result["abandoned"] == result["injected"]


def test_a_scenario_can_be_a_json_file(tmp_path, capsys):
    bundled = resources.files("shoal.sim").joinpath("scenarios/gcp12.json").read_text()
    path = tmp_path / "mine.json"
    path.write_text(bundled)
    args = ["sim", "--scenario", str(path), "--policy", "dtfm", "--nodes", "12", "--stages", "4", "--json"]
    assert main([*args, "--allocation", "given", "--skip", "0.5", "--churn", "0", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == 12


def test_bad_input_is_one_line_and_exit_status_two(capsys):
    assert main(["sim", "--scenario", "atlantis"]) == 2
    assert main(["sim", "--nodes", "3", "--stages", "6"]) == 2
    assert main(["sim", "--skip", "1.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("shoal sim: error:") for line in err)
