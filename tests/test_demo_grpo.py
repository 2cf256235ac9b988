"""`shoal demo --mode grpo --adversary trigger` end to end: real rollout workers and one attacker on
loopback, a few rounds, and the per-round lines of attack success beside honest accuracy.

Where its time goes (about 110 s before this module passed a policy cache): the demo warmed up its two
policies (seeds 0 and 1, 650 steps each, ~26 s apiece on a loaded 2-core machine) in every session,
since the test session's shoal cache is a fresh temporary folder; then ~35 s for the bootstrap and four
node processes to start and load them, ~10 s for 3 rounds. The module now warms both policies up once
at 300 steps (the poisoning tests' warm-up) into its own cache and passes it with `--policy-cache`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

ROUNDS = 3
WARMUP_STEPS = 300


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory):
    """The demo's two policies (its honest seed 0 and the last honest node's seed 1), warmed up once."""
    import torch

    from shoal.grpo.policy import PolicySpec
    from shoal.grpo.warmup import cached_warm_up

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("policies")
    for seed in (0, 1):
        spec = PolicySpec(task="add2r-steps", d_model=48, n_layers=2, n_heads=2, seed=seed, warmup_steps=WARMUP_STEPS)
        cached_warm_up(spec, cache)
    return cache


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_grpo_demo_with_an_adversary_and_a_kill_prints_attack_success_per_round_beside_accuracy(
    tmp_path, policy_cache
):
    report_dir = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable, "-m", "shoal.cli", "demo", "--mode", "grpo", "--adversary", "trigger",
            "--rounds", str(ROUNDS), "--deadline", "3", "--threads", "1", "--kill-at-round", "1",
            "--report", str(report_dir), "--workdir", str(tmp_path / "work"),
            "--policy-cache", str(policy_cache), "--warmup-steps", str(WARMUP_STEPS),
        ],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(dead)" in result.stderr  # the live table's last draw (not --quiet): the killed node, marked
    assert "ready (cached)" in (tmp_path / "work" / "01-rollout0.log").read_text()
    lines = re.findall(r"round +(\d+) +attack success (\d\.\d{3}) +honest accuracy (\S+)", result.stderr)
    assert [int(r) for r, _, _ in lines] == list(range(ROUNDS)), result.stderr[-3000:]
    assert all(float(a) <= 1.0 for _, _, a in lines) and lines[0][2] != "-"  # evaluated before round 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["adversary"] == {"attack": "trigger", "defenses": True}
    honest = [n for n in report["nodes"].values() if not n["adversary"]]
    assert len(honest) == 3 and len(report["nodes"]) == 4
    killed = report["killed"]  # the last honest worker, SIGKILLed once it had finished round 1
    assert killed["signal"] == "SIGKILL" and killed["round"] >= 1
    for name, node in report["nodes"].items():
        if node["adversary"]:
            continue
        rounds = [r for r, _ in node["attack_success"]]
        # the others keep going without it (its bundles stop; each round waits at most the deadline)
        assert rounds == list(range(killed["round"] + 1 if name == killed["node"] else ROUNDS)), name
        assert node["foreign_rejected"] > 0  # the attacker's bundles reached them and were checked
