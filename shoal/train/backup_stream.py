"""A stage's backup as a chain of snapshots that travel as compressed changes and are checked by digest.

A replica of a block stage takes a snapshot of its weights at each backup point: its slow weights φ at
each outer step (there θ ← φ, so φ is the whole stage), or θ every `repair.backup_every` inner steps
in a run without an outer optimizer. The first snapshot goes to a keeper whole (float32); each next
one as its change from the previous snapshot in the int8 blocks of the outer exchange (outer_codec.py,
64 values to a float32 scale: about 1.06 bytes a value, against 8 for θ and φ whole). Both sides build
the next snapshot the same way, `previous + decode(encode(weights - previous))`, on the host in
float32, so they hold the same bytes; what the int8 blocks left out stays in the next change (error
feedback without a buffer: the change is always taken against the snapshot as the keeper holds it).

Every snapshot has a digest over its counters and its tensors' bytes. The replica announces the
digest of its latest snapshot in its signed record, so a keeper can check what it rebuilt, and a node
restoring the stage can check what a keeper hands back against what the stage itself announced
(`verdict`). Everything here is pure: tensors in, snapshots out; node/stage/backups.py moves them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shoal.planning.swarm_view import BackupNote
from shoal.protocol.errors import BadTensor
from shoal.train.outer_codec import INT8_BLOCKS, PieceSpec

Shape = tuple[int, ...]
DIGEST_CHARS = 64  # sha256, hex


class BadBackup(BadTensor):
    """A snapshot whose bytes do not hash to the digest it came with, or that the stage never announced."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A stage's weights at one backup point, float32 on the host, and the digest of it all."""

    tensors: tuple[torch.Tensor, ...]
    inner_step: int
    outer_epoch: int
    version: int  # 1 for a chain's first snapshot, +1 for each next
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.tensors)

    @property
    def shapes(self) -> list[Shape]:
        return [tuple(t.shape) for t in self.tensors]


def snapshot_digest(tensors: Sequence[torch.Tensor], inner_step: int, outer_epoch: int, version: int) -> str:
    """sha256 over the counters and version, then each tensor's shape and float32 bytes in order."""
    digest = hashlib.sha256(f"shoal-backup {version} {inner_step} {outer_epoch} {len(tensors)}".encode())
    for t in tensors:
        digest.update(repr(tuple(t.shape)).encode())
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def first_snapshot(weights: Sequence[torch.Tensor], inner_step: int, outer_epoch: int) -> Snapshot:
    """A chain's first snapshot: the weights as they are (host float32 copies)."""
    tensors = tuple(w.detach().to("cpu", torch.float32, copy=True) for w in weights)
    return Snapshot(tensors, inner_step, outer_epoch, 1, snapshot_digest(tensors, inner_step, outer_epoch, 1))


def next_snapshot(
    previous: Snapshot, weights: Sequence[torch.Tensor], inner_step: int, outer_epoch: int
) -> tuple[Snapshot, list[torch.Tensor]]:
    """The snapshot after `previous` as a keeper holding `previous` rebuilds it from the returned wire
    pieces (int8 blocks of weights - previous, two pieces a tensor)."""
    if len(weights) != len(previous.tensors):
        raise ValueError(f"{len(weights)} tensors against a snapshot of {len(previous.tensors)}")
    pieces: list[torch.Tensor] = []
    for held, now in zip(previous.tensors, weights, strict=True):
        pieces += INT8_BLOCKS.encode(now.detach().to("cpu", torch.float32) - held, 0)
    return _rebuilt(previous, pieces, inner_step, outer_epoch), pieces


def apply_changes(
    previous: Snapshot,
    changes: Sequence[Sequence[torch.Tensor]],
    inner_step: int,
    outer_epoch: int,
    version: int,
    digest: str,
) -> Snapshot:
    """The keeper's side of `next_snapshot`: `previous` moved by each received change in turn (a keeper
    a few snapshots behind gets the changes since its own), which must rebuild the snapshot the sender
    named (`version`, `digest`); raises BadTensor / BadBackup otherwise."""
    if not changes or version != previous.version + len(changes):
        raise BadBackup(f"{len(changes)} change(s) to version {version} of a snapshot at version {previous.version}")
    tensors = list(previous.tensors)
    for pieces in changes:
        if len(pieces) != len(change_specs(previous.shapes)):
            raise BadTensor(f"a snapshot change of {len(pieces)} pieces for {len(previous.tensors)} tensors")
        tensors = _moved(tensors, pieces)
    snapshot = Snapshot(tuple(tensors), inner_step, outer_epoch, version,
                        snapshot_digest(tensors, inner_step, outer_epoch, version))  # fmt: skip
    if snapshot.digest != digest:
        raise BadBackup("the snapshot rebuilt from its changes does not match the digest it came with")
    return snapshot


def whole_snapshot(
    tensors: Sequence[torch.Tensor], inner_step: int, outer_epoch: int, version: int, digest: str
) -> Snapshot:
    """A snapshot received whole (already checked for shape, dtype and finiteness), held to its digest."""
    held = tuple(t.detach().to("cpu", torch.float32) for t in tensors)
    if snapshot_digest(held, inner_step, outer_epoch, version) != digest:
        raise BadBackup("the snapshot's tensors do not match the digest it came with")
    return Snapshot(held, inner_step, outer_epoch, version, digest)


def change_specs(shapes: Sequence[Shape]) -> list[PieceSpec]:
    """The wire pieces of one change, in order (for the receiver's strict reads)."""
    return [spec for shape in shapes for spec in INT8_BLOCKS.specs(shape, 0)]


def verdict(source: str, snapshot: Snapshot, announced: Mapping[str, BackupNote]) -> str | None:
    """Whether a kept snapshot of `source`'s chain is the one that replica announced: None when its
    record names this version with the same digest; "unverified" when no record of `source` at this
    version is left to check it by (records expire a TTL after their node dies); else why it is refused."""
    claim = announced.get(source)
    if claim is None or claim.version != snapshot.version:
        return "unverified"
    if (claim.digest, claim.inner_step, claim.outer_epoch) != (snapshot.digest, snapshot.inner_step,
                                                              snapshot.outer_epoch):  # fmt: skip
        return f"not the snapshot {source[-8:]} announced at version {snapshot.version}"
    return None


def _rebuilt(previous: Snapshot, pieces: Sequence[torch.Tensor], inner_step: int, outer_epoch: int) -> Snapshot:
    tensors = _moved(list(previous.tensors), pieces)
    version = previous.version + 1
    return Snapshot(tuple(tensors), inner_step, outer_epoch, version,
                    snapshot_digest(tensors, inner_step, outer_epoch, version))  # fmt: skip


def _moved(tensors: Sequence[torch.Tensor], pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [held + INT8_BLOCKS.decode(pieces[2 * k : 2 * k + 2], tuple(held.shape)) for k, held in enumerate(tensors)]
