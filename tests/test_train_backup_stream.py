"""A stage's backup chain (shoal/train/backup_stream.py): a keeper that applies each change holds the
replica's snapshot to the bit, a change costs about an eighth of θ and φ whole, and every way a
snapshot can be tampered with (its pieces, its whole tensors, its counters, the chain it names) is
refused by its digest or by what the stage announced."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.planning.swarm_view import BackupNote
from shoal.protocol.errors import BadTensor
from shoal.train.backup_stream import (
    BadBackup,
    apply_changes,
    change_specs,
    first_snapshot,
    next_snapshot,
    snapshot_digest,
    verdict,
    whole_snapshot,
)

SHAPES = [(48, 32), (32,), (7, 5)]


def weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def trained(steps: int) -> list[list[torch.Tensor]]:
    """The weights at each backup point of a short run: small moves, as outer steps make."""
    g = torch.Generator().manual_seed(7)
    now = weights(0)
    points = [now]
    for _ in range(steps):
        now = [w + 0.01 * torch.randn(w.shape, generator=g) for w in now]
        points.append(now)
    return points


def note(snapshot) -> BackupNote:
    return BackupNote(snapshot.version, snapshot.inner_step, snapshot.outer_epoch, snapshot.digest)


def test_a_keeper_following_the_changes_holds_the_replicas_snapshot_to_the_bit_and_stays_close_to_its_weights():
    points = trained(6)
    source = first_snapshot(points[0], 0, 0)
    kept = whole_snapshot(source.tensors, 0, 0, source.version, source.digest)
    for k, now in enumerate(points[1:], start=1):
        source, pieces = next_snapshot(source, now, 10 * k, k)
        kept = apply_changes(kept, [pieces], 10 * k, k, source.version, source.digest)
        assert (kept.version, kept.digest) == (source.version, source.digest) == (k + 1, source.digest)
        assert all(torch.equal(a, b) for a, b in zip(kept.tensors, source.tensors, strict=True))
        # what the int8 blocks leave out stays within one quantum of the change, and is not compounded
        assert max(float((a - b).abs().max()) for a, b in zip(kept.tensors, now, strict=True)) < 0.01 * 4 / 127 * 2
    n = sum(t.numel() for t in points[0])
    change_bytes = sum(spec.nbytes for spec in change_specs(SHAPES))
    assert change_bytes < 1.2 * n  # about 1.06 bytes a value (small tensors pad to a block of 64)
    assert 8 * n / change_bytes > 6  # against θ and φ whole in float32


def test_a_keeper_a_few_snapshots_behind_catches_up_through_the_changes_since_its_own():
    points = trained(3)
    source = first_snapshot(points[0], 0, 0)
    kept, changes = source, []
    for k, now in enumerate(points[1:], start=1):
        source, pieces = next_snapshot(source, now, 10 * k, k)
        changes.append(pieces)
    caught_up = apply_changes(kept, changes, 30, 3, source.version, source.digest)
    assert caught_up.digest == source.digest and caught_up.version == 4
    with pytest.raises(BadBackup, match="does not match"):  # the changes out of order
        apply_changes(kept, [changes[1], changes[0], changes[2]], 30, 3, source.version, source.digest)
    with pytest.raises(BadBackup, match="2 change"):  # one missing
        apply_changes(kept, changes[1:], 30, 3, source.version, source.digest)


def test_a_tampered_change_or_one_applied_to_another_snapshot_is_refused():
    points = trained(2)
    source = first_snapshot(points[0], 0, 0)
    kept = source
    source, pieces = next_snapshot(source, points[1], 10, 1)
    bad = [p.clone() for p in pieces]
    bad[1][0, 0] = bad[1][0, 0] + 1 if int(bad[1][0, 0]) < 127 else bad[1][0, 0] - 1
    with pytest.raises(BadBackup, match="does not match the digest"):
        apply_changes(kept, [bad], 10, 1, source.version, source.digest)
    with pytest.raises(BadBackup, match="does not match the digest"):  # counters lied about
        apply_changes(kept, [pieces], 11, 1, source.version, source.digest)
    with pytest.raises(BadBackup, match="version 3 of a snapshot at version 1"):
        apply_changes(kept, [pieces], 10, 1, 3, source.digest)
    with pytest.raises(BadTensor):  # a piece that is not int8 blocks
        apply_changes(kept, [[pieces[0], pieces[1].float(), *pieces[2:]]], 10, 1, source.version, source.digest)
    with pytest.raises(BadTensor, match="pieces"):
        apply_changes(kept, [pieces[:-1]], 10, 1, source.version, source.digest)
    other = first_snapshot(weights(1), 0, 0)  # a keeper holding some other chain's snapshot
    with pytest.raises(BadBackup):
        apply_changes(other, [pieces], 10, 1, source.version, source.digest)


def test_a_whole_snapshot_is_held_to_its_digest():
    snapshot = first_snapshot(weights(0), 20, 2)
    assert whole_snapshot(snapshot.tensors, 20, 2, 1, snapshot.digest).digest == snapshot.digest
    poisoned = [t.clone() for t in snapshot.tensors]
    poisoned[0][3, 3] += 1e-3
    with pytest.raises(BadBackup):
        whole_snapshot(poisoned, 20, 2, 1, snapshot.digest)
    with pytest.raises(BadBackup):
        whole_snapshot(snapshot.tensors, 30, 3, 1, snapshot.digest)
    digests = {snapshot_digest(snapshot.tensors, *counters) for counters in ((20, 2, 1), (20, 3, 1), (20, 2, 2))}
    assert len(digests) == 3


def test_a_restore_takes_what_the_stage_announced_refuses_what_it_did_not_and_says_when_it_cannot_tell():
    holder = "QmHolderOfStageTwo"
    snapshot = first_snapshot(weights(0), 20, 2)
    assert verdict(holder, snapshot, {holder: note(snapshot)}) is None
    # the record is gone (its node died a TTL ago), or names another version: nothing to hold it to
    assert verdict(holder, snapshot, {}) == "unverified"
    assert verdict(holder, snapshot, {holder: dataclasses.replace(note(snapshot), version=2)}) == "unverified"
    # a keeper's snapshot that is not the one the stage announced at that version
    forged = first_snapshot(weights(1), 20, 2)
    assert "not the snapshot" in verdict(holder, forged, {holder: note(snapshot)})
    moved = dataclasses.replace(note(snapshot), inner_step=19)
    assert "not the snapshot" in verdict(holder, snapshot, {holder: moved})
