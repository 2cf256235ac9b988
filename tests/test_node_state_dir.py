"""A node's saved state (shoal/node/state/store.py): round trip, atomic saves, and refusal of anything
corrupt or foreign, which changes nothing on disk."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from shoal.errors import UsageError
from shoal.model.stages import build_stage
from shoal.node.engine import restore_trained
from shoal.node.state.keeper import trained_state
from shoal.node.state.store import MANIFEST, SavedState, StateDir, StateRefused
from shoal.train.inner import InnerOptimizer
from shoal.train.outer import OuterState
from tests.helpers.tiny import tiny_run

PEER = "QmTestPeer"


def _trained(run, stage: int, steps: int, seed: int = 0) -> tuple[torch.nn.Module, InnerOptimizer]:
    """A stage module and its optimizer after `steps` real steps on random inputs."""
    module = build_stage(run.model, run.pipeline.stages, stage, run.train.seed)
    optimizer = InnerOptimizer(module, run.optim, run.train.steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if stage == 0:  # the data node's stage: embedding, final norm, LM head and loss
            tokens = torch.randint(0, run.model.vocab_size, (2, 9), generator=generator)
            module.loss(module.embed(tokens[:, :-1]), tokens[:, 1:]).backward()
        else:
            module(torch.randn(2, 8, run.model.d_model, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    return module, optimizer


def _state(run, stage: int = 1, steps: int = 3, with_outer: bool = True) -> SavedState:
    module, optimizer = _trained(run, stage, steps)
    adam = optimizer.adamw.state_dict()["state"]
    outer = OuterState.from_module(module)
    return SavedState(
        run_id=run.run_id,
        peer_id=PEER,
        stage=stage,
        role="worker" if stage else "data",
        inner_step=optimizer.step_count,
        outer_epoch=2,
        lr_scale=1.0,
        weights=tuple(p.detach().clone() for p in module.parameters()),
        inner={"state": {i: {k: v.clone() for k, v in e.items()} for i, e in adam.items()}},
        phi=outer.phi if with_outer else None,
        momentum=tuple(torch.full_like(p, 0.5) for p in outer.phi) if with_outer else None,
    )


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_a_saved_stage_loads_back_and_trains_on_exactly_as_the_original(tmp_path):
    run = tiny_run()
    store = StateDir(tmp_path)
    module, optimizer = _trained(run, 1, 3)
    saved = _state(run)
    store.save(saved, run)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["version"] == 2 and manifest["inner_step"] == 3 and manifest["stage"] == 1
    assert (tmp_path / manifest["tensors"]["file"]).stat().st_size == manifest["tensors"]["bytes"]

    loaded = store.load(run, PEER)
    assert loaded is not None
    assert (loaded.stage, loaded.role, loaded.inner_step, loaded.outer_epoch) == (1, "worker", 3, 2)
    for a, b in zip(loaded.weights, saved.weights, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(loaded.momentum, saved.momentum, strict=True):
        assert torch.equal(a, b)

    # restored into a fresh stage, the next step is bit for bit the original's next step
    fresh = build_stage(run.model, run.pipeline.stages, 1, seed=123)
    restored = restore_trained(fresh, trained_state(loaded), run)
    assert restored.step_count == 3
    x = torch.randn(2, 8, run.model.d_model, generator=torch.Generator().manual_seed(9))
    for m, opt in ((module, optimizer), (fresh, restored)):
        m(x).pow(2).mean().backward()
        opt.step()
    for a, b in zip(module.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_data_node_and_a_node_without_averaging_round_trip(tmp_path):
    run = tiny_run()
    store = StateDir(tmp_path)
    store.save(_state(run, stage=0, steps=2, with_outer=False), run)
    loaded = store.load(run, PEER)
    assert loaded.stage == 0 and loaded.role == "data" and loaded.phi is None and loaded.momentum is None


def test_nothing_saved_is_no_state(tmp_path):
    assert StateDir(tmp_path).load(tiny_run(), PEER) is None


def test_a_save_cut_short_never_replaces_the_good_one(tmp_path):
    run = tiny_run()
    store = StateDir(tmp_path)
    store.save(_state(run, steps=2), run)
    good = _files(tmp_path)

    # killed between the two halves of a save: the new tensors are on disk, the manifest is not
    store.write_tensors(_state(run, steps=4))
    # and killed while writing a manifest and a tensor file: what a kill leaves is a temp file
    (tmp_path / f".{MANIFEST}.999.1.tmp").write_text('{"format": "shoal-node-st')
    (tmp_path / ".state.999.1.tmp").write_bytes(b"PK\x03\x04 half a zip")
    loaded = store.load(run, PEER)
    assert loaded.inner_step == 2
    assert {k: v for k, v in _files(tmp_path).items() if k in good} == good

    store.save(_state(run, steps=5), run)  # the next complete save drops tensors no manifest names
    assert store.load(run, PEER).inner_step == 5
    assert len(list(tmp_path.glob("state-*.pt"))) == 1


SAVER = textwrap.dedent(
    """
    import sys, torch
    from shoal.node.state.store import SavedState, StateDir
    from tests.helpers.tiny import tiny_run
    from tests.test_node_state_dir import _state

    torch.set_num_threads(1)
    run, store = tiny_run(), StateDir(sys.argv[1])
    base = _state(run, steps=1)
    step = 0
    while True:  # save ever bigger steps, as fast as it can, until killed
        step += 1
        weights = tuple(w + step for w in base.weights)
        store.save(SavedState(**{**base.__dict__, "inner_step": step, "weights": weights}), run)
    """
)


def test_a_node_killed_in_the_middle_of_saving_leaves_a_loadable_state(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], cwd=repo, stderr=subprocess.PIPE)
    try:
        run = tiny_run()
        deadline = time.monotonic() + 60
        while not (tmp_path / MANIFEST).exists():
            assert saver.poll() is None, saver.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the saver never saved"
            time.sleep(0.05)
        time.sleep(0.3)  # a few more saves, then a kill at whatever point it has reached
    finally:
        os.kill(saver.pid, signal.SIGKILL)
        saver.wait(timeout=10)
        saver.stderr.close()
    loaded = StateDir(tmp_path).load(run, PEER)
    assert loaded is not None and loaded.inner_step >= 1
    base = _state(run, steps=1)
    assert torch.equal(loaded.weights[0], base.weights[0] + loaded.inner_step)  # the tensors of that very save


def _refused(store: StateDir, run, peer: str = PEER) -> str:
    """Load must refuse, naming the file, and change nothing on disk."""
    before = _files(store.path)
    with pytest.raises(StateRefused) as refused:
        store.load(run, peer)
    assert _files(store.path) == before
    message = str(refused.value)
    assert str(store.path) in message and "Nothing was changed" in message
    return message


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _rewrite_manifest(path: Path, **changes) -> None:
    (path / MANIFEST).write_text(json.dumps({**_manifest(path), **changes}))


@pytest.fixture
def saved(tmp_path) -> StateDir:
    store = StateDir(tmp_path)
    store.save(_state(tiny_run()), tiny_run())
    return store


def test_a_manifest_that_is_not_json_is_refused(saved):
    (saved.path / MANIFEST).write_text('{"format": "shoal-node-state", "vers')
    assert "manifest.json: is not valid JSON" in _refused(saved, tiny_run())


def test_another_format_version_is_refused(saved):
    _rewrite_manifest(saved.path, version=99)
    assert "format version 99; this shoal reads 2" in _refused(saved, tiny_run())


def test_a_truncated_tensor_file_is_refused(saved):
    file = saved.path / _manifest(saved.path)["tensors"]["file"]
    file.write_bytes(file.read_bytes()[:-100])
    message = _refused(saved, tiny_run())
    assert f"{file}: is truncated or altered" in message


def test_a_corrupt_tensor_file_is_refused(saved):
    file = saved.path / _manifest(saved.path)["tensors"]["file"]
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    assert "does not match its checksum in the manifest (corrupt)" in _refused(saved, tiny_run())


def test_a_missing_tensor_file_is_refused(saved):
    (saved.path / _manifest(saved.path)["tensors"]["file"]).unlink()
    assert "is named by manifest.json but cannot be read" in _refused(saved, tiny_run())


def test_state_of_another_run_model_shape_stage_count_or_peer_is_refused(saved):
    other_run = tiny_run(**{"train.steps": 99})
    assert f"this node joins run test-tiny@{other_run.run_id}" in _refused(saved, other_run)
    assert "another model shape (d_model 32 there, 64 here)" in _refused(saved, tiny_run(**{"model.d_model": 64}))
    four = tiny_run(**{"pipeline.stages": 4})
    assert "was saved for a run of 3 stages; run test-tiny has 4" in _refused(saved, four)
    someone_else = _refused(saved, tiny_run(), "QmSomeoneElse")
    assert "was saved by peer QmTestPeer, and this node is QmSomeoneElse" in someone_else


def test_tensors_of_the_wrong_shape_are_refused_even_with_a_good_checksum(tmp_path):
    run = tiny_run()
    store = StateDir(tmp_path)
    bad = _state(run)
    weights = list(bad.weights)
    weights[0] = torch.zeros(3, 3)
    store.save(SavedState(**{**bad.__dict__, "weights": tuple(weights)}), run)
    assert "weights tensor 0 has shape (3, 3)" in _refused(store, run)


def test_a_nan_in_the_saved_weights_is_refused(tmp_path):
    run = tiny_run()
    store = StateDir(tmp_path)
    bad = _state(run)
    weights = list(bad.weights)
    weights[1] = torch.full_like(weights[1], float("nan"))
    store.save(SavedState(**{**bad.__dict__, "weights": tuple(weights)}), run)
    assert "weights tensor 1 holds NaN or infinite values" in _refused(store, run)


class Payload:
    """Not a tensor: what a pickle-based loader would construct (and run code for)."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickled_object_is_never_loaded(saved):
    manifest = _manifest(saved.path)
    file = saved.path / manifest["tensors"]["file"]
    torch.save({"weights": Payload(), "inner": {}, "phi": None, "momentum": None}, file, pickle_module=pickle)
    import hashlib

    data = file.read_bytes()
    manifest["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (saved.path / MANIFEST).write_text(json.dumps(manifest))
    assert "cannot be read as plain tensors" in _refused(saved, tiny_run())


def test_a_state_dir_is_used_by_one_node_at_a_time(tmp_path):
    first, second = StateDir(tmp_path), StateDir(tmp_path)
    first.acquire()
    try:
        with pytest.raises(UsageError, match=f"{tmp_path} is in use by another node \\(pid {os.getpid()}\\)"):
            second.acquire()
    finally:
        first.release()
    second.acquire()
    second.release()


def test_a_killed_nodes_forked_children_do_not_keep_its_state_dir_locked(tmp_path):
    """hivemind forks the DHT from the node after the lock is taken; when the node is SIGKILLed that
    child lives on a while, and the folder must be free for the node that comes back."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from shoal.node.state.store import StateDir
        StateDir({str(tmp_path)!r}).acquire()
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(UsageError, match=f"in use by another node \\(pid {holder.pid}\\)"):
            StateDir(tmp_path).acquire()
        holder.kill()
        holder.wait(timeout=10)
        again = StateDir(tmp_path)
        os.kill(child, 0)  # the forked child still runs, and holds nothing
        again.acquire()
        again.release()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"role": "boss"}, "role"),
        ({"inner_step": -1}, "inner_step"),
        ({"lr_scale": "fast"}, "lr_scale"),
        ({"stage": True}, "stage"),
        ({"model": {"d_model": 32}}, "model.vocab_size"),
        ({"tensors": {"file": "../../etc/passwd", "bytes": 1, "sha256": "0" * 64}}, "tensors.file"),
        ({"surplus": 1}, "surplus"),
    ],
)
def test_a_malformed_manifest_field_is_refused_by_name(saved, changes, field):
    _rewrite_manifest(saved.path, **changes)
    assert f"has a missing or malformed '{field}'" in _refused(saved, tiny_run())
