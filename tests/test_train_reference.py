from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from shoal.train.schedule import learning_rate
from tests.helpers.tiny import sample_text, tiny_run, write_tiny_run


def test_schedule_warms_up_then_decays_to_the_floor():
    run = tiny_run()
    o, total = run.optim, 100
    rates = [learning_rate(s, o, total) for s in range(total)]
    assert rates[0] == pytest.approx(o.lr / o.warmup_steps)
    assert max(rates) == pytest.approx(o.lr)
    assert rates[-1] == pytest.approx(o.lr * o.min_lr_ratio, rel=0.05)
    assert all(a >= b for a, b in zip(rates[o.warmup_steps :], rates[o.warmup_steps + 1 :], strict=False))


def test_reference_trainer_learns_and_is_reproducible(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(sample_text(30000))
    run = tiny_run(**{"data.path": str(path), "train.steps": 40})
    splits = load_token_splits(run.data, run.model.vocab_size)
    first = ReferenceTrainer(run, splits).train()
    assert first.final_loss < 0.7 * first.initial_loss
    assert first.val_loss < first.initial_loss
    second = ReferenceTrainer(run, splits).train()
    assert [r.loss for r in first.history] == [r.loss for r in second.history]


@pytest.mark.slow
def test_cli_writes_report_and_plot(tmp_path):
    config = write_tiny_run(tmp_path)
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "train",
            "--local",
            "--run-config",
            str(config),
            "--steps",
            "30",
            "--report",
            str(out),
            "--quiet",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    for key in ("steps", "initial_loss", "final_loss", "val_loss", "tokens_per_s", "params"):
        assert key in report
    assert report["steps"] == 30 and report["final_loss"] < report["initial_loss"]
    assert (out / "loss.png").stat().st_size > 1000
