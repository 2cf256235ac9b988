"""Replicas of a stage train one model, over real daemons: NoLoCo pairs average every H steps, and
a node that joins mid-run copies a live replica's weights before it serves."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


def _averaging(path) -> dict:
    return json.loads(path.read_text())["engine"]["averaging"]


def test_noloco_pairs_average_every_h_steps_and_end_each_epoch_in_agreement(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 12, "averaging.inner_steps": 3})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = {(s, i): tmp_path / f"stage{s}-{i}.json" for s in (1, 2) for i in (0, 1)}
    workers = {
        key: swarm.start_node(
            [entry], "--role", "worker", "--stage", str(key[0]), "--stats-file", str(path), wait=False
        )  # fmt: skip
        for key, path in stats.items()
    }
    for worker in workers.values():
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--progress-file", str(progress))
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    for worker in workers.values():
        assert swarm.stop(worker) == 0

    for stage in (1, 2):
        a, b = _averaging(stats[(stage, 0)]), _averaging(stats[(stage, 1)])
        for side in (a, b):
            assert side["outer_epoch"] == 12 // 3  # every epoch of the data node's clock
            assert side["pair_steps"] == 4 and side["local_steps"] == 0 and side["refused"] == 0
            distances = [d for _, d in side["replica_distance"]]
            assert all(d > 0 for d in distances) and distances[-1] < distances[0]  # they drift apart less and less
        # and each pair update brings them back together: the same slow weights on both sides
        assert a["phi_checksum"] == pytest.approx(b["phi_checksum"], rel=1e-6, abs=1e-6)


def test_a_node_started_mid_run_serves_with_copied_weights(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 40, "averaging.inner_steps": 5})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    fast = ("--record-ttl", "6")  # heartbeats every 2 s: the data node routes to the newcomer soon after it joins
    swarm.start_node([entry], *fast, "--role", "worker", "--stage", "1", wait=False)
    # stage 2 holds step 15's gradients for a while, so the newcomer joins mid-run however busy the machine is
    holder = swarm.start_node([entry], *fast, "--role", "worker", "--stage", "2", "--inject-upstream-delay", "15:25",
                              wait=False)  # fmt: skip
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], *fast, "--role", "data", "--progress-file", str(progress))
    wait_until(lambda: "holding the gradient" in holder.log(), 240, "the hold at step 15")

    newcomer = swarm.start_node([entry], *fast, "--role", "worker", "--stage", "1", "--stats-file",
                                str(tmp_path / "newcomer.json"))  # fmt: skip
    assert "copied stage 1 from" in newcomer.log()
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    losses = {e["step"]: e["loss"] for e in progress_events(progress) if e["event"] == "step"}
    before = min(losses[s] for s in range(10, 16))
    after = [losses[s] for s in range(16, 40)]
    # half the microbatches now pass through the newcomer: a fresh stage would send the loss back up
    # to about ln(vocab) = 5.7; copied weights keep it where the swarm was
    assert max(after) < before + 0.5, (before, after)
    assert losses[39] < losses[0] - 1.0
    assert swarm.stop(newcomer) == 0
    assert json.loads((tmp_path / "newcomer.json").read_text())["engine"]["forwards"] > 0  # it did serve


def test_diloco_all_reduces_every_h_steps_through_hivemind_and_replicas_agree(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 9, "averaging.mode": "diloco", "averaging.inner_steps": 3,
                                           "averaging.alpha": 0.3})  # fmt: skip
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = {i: tmp_path / f"stage1-{i}.json" for i in (0, 1)}
    workers = [  # started together: the junior replica waits for the senior's averaging DHT and joins it
        swarm.start_node([entry], "--role", "worker", "--stage", "1", "--stats-file", str(path), wait=False)
        for path in stats.values()
    ]
    workers.append(swarm.start_node([entry], "--role", "worker", "--stage", "2", wait=False))
    for worker in workers:
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--progress-file", str(progress))
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    for worker in workers[:2]:
        assert swarm.stop(worker) == 0
    a, b = _averaging(stats[0]), _averaging(stats[1])
    for side in (a, b):
        assert side["mode"] == "diloco" and side["outer_epoch"] == 3
        assert side["group_steps"] == 3 and side["local_steps"] == 0 and set(side["group_sizes"]) == {2}
    assert a["phi_checksum"] == pytest.approx(b["phi_checksum"], rel=1e-6, abs=1e-6)


def _stage1_replicas(swarm, tmp_path, replicas: int, codec: str) -> list[dict]:
    """12 steps, NoLoCo every 3, with `replicas` replicas of stage 1 and one of stage 2; the averaging
    stats of stage 1's replicas, once every microbatch completed."""
    run_file = write_tiny_run(tmp_path, **{"train.steps": 12, "averaging.inner_steps": 3, "averaging.codec": codec})
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = [tmp_path / f"stage1-{i}.json" for i in range(replicas)]
    workers = [swarm.start_node([entry], "--role", "worker", "--stage", "1", "--stats-file", str(path), wait=False)
               for path in stats]  # fmt: skip
    workers.append(swarm.start_node([entry], "--role", "worker", "--stage", "2", wait=False))
    for worker in workers:
        swarm.wait_ready(worker)
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--role", "data", "--progress-file", str(progress))
    done = wait_until(lambda: done_event(progress), 300, "the data node to finish")
    assert done["microbatches_abandoned"] == 0
    for worker in workers:
        assert swarm.stop(worker) == 0
    return [_averaging(path) for path in stats]


def test_noloco_pairs_exchange_compressed_pseudo_gradients_and_still_come_together(swarm, tmp_path):
    a, b = _stage1_replicas(swarm, tmp_path, 2, "topk")
    for side in (a, b):
        assert side["codec"] == "topk" and side["pair_steps"] == 4 and side["refused"] == 0
        # 2 % of Δ, and no φ: two replicas that applied the same updates hold the same φ, and say so first
        assert side["phi_skipped"] == 4
        assert side["bytes_sent"] == 4 * (side["bytes_per_exchange"] - side["phi_bytes_per_exchange"])
        assert side["screened_out"] == 0  # a Δ that carries earlier epochs' rest is not taken for an attack
    # both started from one φ and average the same decoded Δs: their φ stay the same to the bit
    assert a["phi_checksum"] == b["phi_checksum"]


def test_noloco_sends_phi_only_to_a_partner_whose_phi_differs(swarm, tmp_path):
    """Three replicas of a stage: each epoch one of them has no partner and steps alone, so its φ parts
    from the others', and a later pair with it must carry φ; a pair of replicas that took the same
    updates sends only Δ. Every byte sent is accounted for by that rule."""
    sides = _stage1_replicas(swarm, tmp_path, 3, "int8")
    for side in sides:
        assert side["codec"] == "int8" and side["refused"] == 0
        delta_bytes = side["bytes_per_exchange"] - side["phi_bytes_per_exchange"]
        with_phi = side["pair_steps"] - side["phi_skipped"]
        assert side["bytes_sent"] == side["pair_steps"] * delta_bytes + with_phi * side["phi_bytes_per_exchange"]
    pairs = sum(side["pair_steps"] for side in sides)
    skipped = sum(side["phi_skipped"] for side in sides)
    assert pairs >= 6  # a pair in each of the 4 epochs, but for one that may fall through
    assert 0 < skipped < pairs  # the first epoch's pair held the same φ; a pair with a lone stepper did not
