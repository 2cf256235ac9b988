"""A node with a --state-dir that is killed and started again comes back as itself: the same peer
id, its stage, its saved weights and counters, and the swarm loses no microbatch over it; where its
only initial peer died meanwhile, it joins through the live peers its state dir kept. A corrupt
state file is refused with one clear line, and nothing on disk changes."""

from __future__ import annotations

import json

import pytest

from shoal.dht.identity import load_identity
from shoal.model.stages import build_stage
from shoal.node.state.peers import known_peers
from shoal.node.state.store import MANIFEST, SavedState, StateDir
from shoal.p2p.restarts import RestartWatch
from shoal.planning.swarm_view import NodeInfo, SwarmView
from shoal.run_files import load_run_config
from tests.helpers.processes import done_event, wait_until
from tests.helpers.tiny import write_tiny_run

TTL = "6"


def _manifest(state_dir) -> dict:
    path = state_dir / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def _files(state_dir) -> dict[str, bytes]:
    """What a node keeps in its state dir (the lock file aside: a starting node takes it)."""
    return {p.name: p.read_bytes() for p in sorted(state_dir.iterdir()) if p.is_file() and p.name != "lock"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_worker_comes_back_as_itself_with_its_saved_weights_and_nothing_is_lost(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path, **{"train.steps": 20})
    bootstrap = swarm.start_bootstrap("--run-config", str(run_file))
    entry = bootstrap.maddrs[0]
    common = ("--record-ttl", TTL, "--role", "worker")
    state = tmp_path / "state"
    keep = ("--state-dir", str(state), "--save-every-s", "0.5")
    progress = tmp_path / "progress.jsonl"
    peers = [  # all at once: the data node waits for the pipeline
        swarm.start_node([entry], *common, "--stage", "1", wait=False),
        # it holds step 8's gradients, so that it dies mid-run however fast the steps go (20 steps took
        # 1.2 s once, and the kill came after the last save: nothing was left to train after it)
        swarm.start_node([entry], *common, "--stage", "2", *keep, "--inject-upstream-delay", "8:60", wait=False),
        swarm.start_node([entry], "--role", "data", "--record-ttl", TTL, "--progress-file", str(progress), wait=False),
    ]
    for peer in peers:
        swarm.wait_ready(peer)
    kept = peers[1]

    wait_until(lambda: "holding the gradient" in kept.log(), 120, "the hold at step 8")
    wait_until(lambda: _manifest(state).get("inner_step", 0) >= 5, 120, "a save at inner step 5")
    wait_until(lambda: len(known_peers(state)) >= 2, 60, "the live peers kept in the state dir")
    swarm.kill(kept)  # SIGKILL: stage 2's only replica, and everything it held in flight
    swarm.kill(bootstrap)  # and the only initial peer it is given again: it joins through those it kept
    saved = _manifest(state)
    assert (saved["peer_id"], saved["stage"], saved["role"]) == (kept.peer_id, 2, "worker")

    # no --stage this time: it takes its saved stage back because the swarm still needs it
    again = swarm.start_node([entry], *common, *keep, "--stats-file", str(tmp_path / "again.json"))
    assert again.peer_id == kept.peer_id and again.stage == 2
    assert "more seen live before this restart" in again.log()
    assert f"resumed stage 2 from {state} (inner step {saved['inner_step']}," in again.log()

    done = wait_until(lambda: done_event(progress), 180, "the data node to finish")
    assert done["microbatches_abandoned"] == 0, done["abandoned_reasons"]
    assert done["microbatches_completed"] == done["microbatches_injected"] and done["steps"] == 20
    assert swarm.stop(again) == 0
    stepped = json.loads((tmp_path / "again.json").read_text())["engine"]["inner_steps"]
    assert stepped > saved["inner_step"]  # it went on from its save, not from 0
    final = _manifest(state)
    assert final["inner_step"] == stepped and final["saved_at"] > saved["saved_at"]  # saved at shutdown


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_corrupt_state_file_is_refused_with_one_line_and_nothing_changes(swarm, tmp_path):
    run_file = write_tiny_run(tmp_path)
    run = load_run_config(str(run_file))
    state = tmp_path / "state"
    state.mkdir()
    load_identity(str(state / "identity"))  # a node that ran before: its identity, and a state it saved
    module = build_stage(run.model, run.pipeline.stages, 1, run.train.seed)
    weights = tuple(p.detach().clone() for p in module.parameters())
    store = StateDir(state)
    tensors = store.save(SavedState(run.run_id, "QmAnyPeer", 1, "worker", 7, 0, 1.0, weights, {"state": {}}), run)
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit, as a failing disk would leave it
    tensors.write_bytes(bytes(data))
    before = _files(state)

    node = swarm.start_node([], "--run-config", str(run_file), "--state-dir", str(state), wait=False)
    assert node.process.wait(timeout=90) == 2
    log = node.log()
    assert f"refusing the saved state {tensors}: does not match its checksum in the manifest (corrupt)" in log
    assert "Traceback" not in log and not node.ready_file.exists()
    assert _files(state) == before


def _view(*nodes: tuple[str, float]) -> SwarmView:
    infos = tuple(NodeInfo(peer, "worker", 1, "active", 1.0, 1, started_at=at) for peer, at in nodes)
    return SwarmView("run", 3, (0, 2, 2), infos)


def test_a_peer_seen_with_a_later_start_is_a_restart():
    watch = RestartWatch()
    assert watch.restarted(_view(("a", 1.0), ("b", 2.0))) == set()
    assert watch.restarted(_view(("a", 1.0), ("b", 2.0))) == set()
    assert watch.restarted(_view(("a", 5.0))) == {"a"}  # b left: not a restart
    assert watch.restarted(_view(("a", 1.0), ("b", 2.0))) == set()  # an older record read again is not one
    assert watch.restarted(_view(("a", 5.0), ("b", 7.0))) == {"b"}
