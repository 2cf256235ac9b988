from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.config import ConfigError, parse_run_config
from shoal.node.config import ExperimentOptions, LimitOptions, NodeConfig
from shoal.run_files import bundled_runs, load_run_config

TINY = load_run_config("tiny")


def test_bundled_tiny_run_loads_and_round_trips_through_toml():
    assert "tiny" in bundled_runs()
    again = parse_run_config(TINY.to_toml())
    assert again == TINY
    assert again.run_id == TINY.run_id


def test_run_id_changes_with_any_field():
    assert TINY.replace({"optim.lr": 1e-3}).run_id != TINY.run_id


def test_the_pipeline_defenses_are_on_by_default_and_leave_run_ids_as_they_were():
    assert TINY.defense.robust_outer and TINY.defense.audit_rate > 0
    assert parse_run_config("[defense]\naudit_rate = 0.1\n").run_id == parse_run_config("").run_id
    off = TINY.replace({"defense.robust_outer": False, "defense.audit_rate": 0.0})
    assert off.run_id != TINY.run_id and parse_run_config(off.to_toml()) == off


def test_skippipes_settings_default_to_the_authors_and_leave_run_ids_as_they_were():
    assert (TINY.skippipe.timetable, TINY.skippipe.max_jump, TINY.skippipe.full_pass_every) == (True, 3, 10)
    assert parse_run_config("[skippipe]\nmax_jump = 3\n").run_id == parse_run_config("").run_id
    alone = TINY.replace({"skippipe.timetable": False})
    assert alone.run_id != TINY.run_id and parse_run_config(alone.to_toml()) == alone


def test_how_often_a_data_node_evaluates_is_not_part_of_the_run():
    every_step = TINY.replace({"train.eval_every": 1})
    assert every_step.run_id == TINY.run_id and parse_run_config(every_step.to_toml()) == every_step
    assert [every_step.train.evaluates_after(s) for s in range(3)] == [True, True, True]
    assert not every_step.train.evaluates_after(TINY.train.steps - 1)  # the last: evaluated at the end anyway
    assert not any(TINY.train.evaluates_after(s) for s in range(TINY.train.steps))


@pytest.mark.parametrize(
    "toml, field",
    [
        ("[model]\nn_layers = 2\n[pipeline]\nstages = 4\n", "pipeline.stages"),
        ("[model]\nwidth = 3\n", "model.width"),
        ("colour = 'red'\n", "colour"),
        ("[model]\nd_model = 130\nn_heads = 4\n", "model.n_heads"),
        ("[train]\nbatch_size = 10\nmicrobatch_size = 4\n", "train.microbatch_size"),
        ("[train]\nsteps = 'many'\n", "train.steps"),
        ("[train]\nseq_len = 4096\n", "train.seq_len"),
        ("[optim]\nlr = -1\n", "optim.lr"),
        ("[pipeline]\nwire_dtype = 'int4'\n", "pipeline.wire_dtype"),
        ("model = 3\n", "model"),
        ("[train]\nsteps = true\n", "train.steps"),
        ("[defense]\naudit_rate = 2.0\n", "defense.audit_rate"),
        ("[defense]\nouter_tolerance = 1.0\n", "defense.outer_tolerance"),
        ("[defense]\naudits = true\n", "defense.audits"),
        ("[train]\neval_every = -1\n", "train.eval_every"),
        ("[repair]\nedge_copy_every = 0\n", "repair.edge_copy_every"),
        ("[averaging]\nstage0 = 'sum'\n", "averaging.stage0"),
        ("[averaging]\nstage0_every = 0\n", "averaging.stage0_every"),
        ("[averaging]\nstage0_resync_every = 0\n", "averaging.stage0_resync_every"),
        ("[skippipe]\nmax_jump = -1\n", "skippipe.max_jump"),
        ("[skippipe]\nfull_pass_every = -2\n", "skippipe.full_pass_every"),
        ("[skippipe]\ntimetable = 'yes'\n", "skippipe.timetable"),
        ("[model]\nsubspace_rank = 128\n", "model.subspace_rank"),
        ("[model]\nsubspace_rank = -1\n", "model.subspace_rank"),
        ("[model]\nsubspace_rank = 8\ntie_embeddings = true\n", "model.subspace_rank"),
        ("[model]\nsubspace_rank = 8\nmax_seq_len = 8192\n[train]\nmicrobatch_size = 4\n", "train.microbatch_size"),
    ],
)
def test_bad_configs_name_the_field(toml, field):
    with pytest.raises(ConfigError) as info:
        parse_run_config(toml)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_not_toml_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_run_config("[model\n")


@pytest.mark.parametrize(
    "toml, fragment",
    [("[model]\nn_layers = 2\n[pipeline]\nstages = 4\n", "pipeline.stages"), ("[model]\nwidth = 3\n", "model.width")],
)
def test_cli_refuses_bad_config_with_one_line_and_no_traceback(tmp_path, toml, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "train",
            "--local",
            "--run-config",
            str(path),
            "--report",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_refuses_missing_config_file(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "train", "--local", "--run-config", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "cannot read run config" in result.stderr and "Traceback" not in result.stderr


def test_a_node_uses_torchs_default_threads_unless_told_and_refuses_zero():
    assert NodeConfig().limits.threads is None  # torch's default: every core the process may use
    assert LimitOptions(threads=3).threads == 3
    with pytest.raises(ConfigError, match="--threads"):
        LimitOptions(threads=0)
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "node", "--threads", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--threads" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_a_node_refuses_an_exit_timeout_that_is_not_positive():
    assert NodeConfig().limits.exit_timeout_s == 60.0  # the drain, the last save and leaving take seconds
    with pytest.raises(ConfigError, match="--exit-timeout"):
        LimitOptions(exit_timeout_s=0)


def test_a_node_refuses_a_negative_crash_step():
    assert NodeConfig().experiment.crash_at_step is None
    with pytest.raises(ConfigError, match="--inject-crash-at-step"):
        ExperimentOptions(crash_at_step=-1)


def test_node_flags_are_generated_from_the_config_sections_with_one_default():
    """`shoal node`'s flags come from NodeConfig's sections: no flags give the dataclass defaults, and
    each flag lands in its section's field (the parse functions included)."""
    from shoal.cli import build_parser
    from shoal.node.config import SECTIONS
    from shoal.options import options_of

    parser = build_parser()
    assert NodeConfig.from_args(parser.parse_args(["node"])) == NodeConfig()
    flags = [opt.flag for section in SECTIONS for _, opt, _ in options_of(section)]
    assert len(flags) == len(set(flags)) and "--record-ttl" in flags and "--policy-width" in flags
    given = ["node", "--record-ttl", "9", "--no-relay", "--data-shard", "1/3", "--host-maddrs", "/ip4/0.0.0.0/tcp/7",
             "--inject-close-stall", "4:2.5", "--policy-width", "64", "--role", "worker", "--stage", "2"]  # fmt: skip
    config = NodeConfig.from_args(parser.parse_args(given))
    assert (config.network.record_ttl_s, config.network.use_relay) == (9.0, False)
    assert config.network.host_maddrs == ("/ip4/0.0.0.0/tcp/7",) and config.placement.data_shard == (1, 3)
    assert config.experiment.close_stall == (4, 2.5) and config.policy.width == 64
    assert (config.placement.role, config.placement.stage) == ("worker", 2)
    with pytest.raises(ConfigError, match="--stage"):
        NodeConfig.from_args(parser.parse_args(["node", "--role", "data", "--stage", "1"]))
