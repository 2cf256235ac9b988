"""`shoal demo --mode grpo --adversary trigger` end to end: real rollout workers and one attacker on
loopback, a few rounds, and the per-round lines of attack success beside honest accuracy."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

ROUNDS = 3


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_grpo_demo_with_an_adversary_prints_attack_success_per_round_beside_accuracy(tmp_path):
    report_dir = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable, "-m", "shoal.cli", "demo", "--mode", "grpo", "--adversary", "trigger",
            "--rounds", str(ROUNDS), "--deadline", "3", "--quiet", "--threads", "1",
            "--report", str(report_dir), "--workdir", str(tmp_path / "work"),
        ],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"round +(\d+) +attack success (\d\.\d{3}) +honest accuracy (\S+)", result.stderr)
    assert [int(r) for r, _, _ in lines] == list(range(ROUNDS)), result.stderr[-3000:]
    assert all(float(a) <= 1.0 for _, _, a in lines) and lines[0][2] != "-"  # evaluated before round 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["adversary"] == {"attack": "trigger", "defenses": True}
    honest = [n for n in report["nodes"].values() if not n["adversary"]]
    assert len(honest) == 3 and len(report["nodes"]) == 4
    for node in honest:
        assert [r for r, _ in node["attack_success"]] == list(range(ROUNDS))
        assert node["foreign_rejected"] > 0  # the attacker's bundles reached them and were checked
