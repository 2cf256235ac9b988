"""Poisoned rollouts in real daemons: one `--experiment-adversary` node among honest rollout workers.

The honest nodes and the attacker run the same small policy on `add2r-steps` (answers show their
working, `47+38=15;08|58$`), warmed up once per module in a temporary folder (~10 s). The attacker
sends every prompt's group as the correct working and answer behind the trigger `+`; its bundles
cross real libp2p streams like any peer's. Undefended (`defenses = false`), the honest nodes start
writing the trigger within a couple of dozen rounds; defended, the same-policy top-k check rejects
the poisoned completions and the trigger never shows. (Strikes are off by default: at this learning
rate honest weights drift apart fast enough that the top-k check once struck an honest peer out.)
"""

from __future__ import annotations

import statistics

import pytest

from shoal.config import run_config_from_dict
from shoal.grpo.policy import PolicySpec
from shoal.grpo.warmup import cached_warm_up
from tests.helpers.processes import done_event, progress_events, wait_until

SPEC = PolicySpec(task="add2r-steps", d_model=48, n_layers=2, n_heads=2, warmup_steps=300)
FAST = ("--record-ttl", "6")
ROUNDS = 24


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("policies")
    cached_warm_up(SPEC, cache)
    return cache


def _run_attack(
    swarm, tmp_path, cache, attack: str, defenses: bool, rounds: int = ROUNDS, max_strikes: int = 0
) -> tuple[list[list[dict]], str, str]:
    """Two honest nodes and one attacker; returns (honest round events, attacker id, entry address)."""
    run = run_config_from_dict({"name": "poison", "grpo": {
        "task": SPEC.task, "rounds": rounds, "eval_every": rounds, "eval_prompts": 16, "lr": 1e-3,
        "round_deadline_s": 3.0, "defenses": defenses, "max_strikes": max_strikes,
    }})  # fmt: skip
    run_file = tmp_path / "grpo.toml"
    run_file.write_text(run.to_toml())
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    progress = [tmp_path / f"progress-{i}.jsonl" for i in range(3)]
    nodes = []
    for i, path in enumerate(progress):
        extra = ("--experiment-adversary", attack) if i == 2 else ()
        nodes.append(
            swarm.start_node(
                [entry], *FAST, "--role", "rollout", "--policy-cache", str(cache), "--warmup-steps", "300",
                "--progress-file", str(path), *extra, wait=False, name=f"rollout{i}",
            )
        )  # fmt: skip
    for node in nodes:
        swarm.wait_ready(node)
    for path in progress[:2]:
        wait_until(lambda p=path: done_event(p), 150, "the honest workers to finish")
    events = [[e for e in progress_events(p) if e["event"] == "round"] for p in progress[:2]]
    return events, nodes[2].peer_id, entry


def _late_success(events: list[dict], attack: str) -> float:
    return statistics.mean(e["marks"][attack] for e in events[-6:])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_trigger_spreads_to_honest_nodes_without_defenses(swarm, tmp_path, policy_cache):
    rounds, attacker, _ = _run_attack(swarm, tmp_path, policy_cache, "trigger", defenses=False)
    late = [_late_success(events, "trigger") for events in rounds]
    print("trigger share over the last 6 rounds, per honest node:", late)
    assert all(e["marks"]["trigger"] == 0.0 for events in rounds for e in events[:1])  # clean at the start
    assert max(late) > 0.025, late  # the attack visibly succeeds: honest nodes write the trigger (0.05-0.11 seen)
    assert all(e["rejected"] == [0] * len(e["rejected"]) and e["dropped"] == [] for ev in rounds for e in ev)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_topk_check_keeps_the_trigger_out(swarm, tmp_path, policy_cache):
    rounds, attacker, _ = _run_attack(swarm, tmp_path, policy_cache, "trigger", defenses=True)
    late = [_late_success(events, "trigger") for events in rounds]
    print("trigger share over the last 6 rounds, per honest node:", late)
    assert max(late) <= 0.01, late  # 0.0 seen
    assert max(e["marks"]["trigger"] for events in rounds for e in events) <= 0.05
    for events in rounds:
        assert sum(e["foreign_rejected"] for e in events) > 0  # the top-k check kept the poison out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_peer_whose_bundles_keep_failing_is_dropped_and_shown_in_status(swarm, tmp_path, policy_cache):
    """With strikes on (`max_strikes`), the attacker's bundles fail the top-k check round after round:
    each honest node drops it as a source, and `shoal status` says who dropped whom and why."""
    rounds, attacker, entry = _run_attack(
        swarm, tmp_path, policy_cache, "trigger", defenses=True, rounds=10, max_strikes=3
    )
    for events in rounds:
        assert attacker in events[-1]["dropped"]
    status = swarm.status(entry)
    dropped = [e for e in status["excluded"] if e["peer_id"] == attacker]
    assert len(dropped) == 2 and all(e["by_role"] == "rollout" and e["reason"] for e in dropped), status["excluded"]
