"""Stage backups, a repair rule beyond the papers (`repair.backup_every`, on by default): every block
stage is kept, in memory, by the workers of one neighbouring block stage (stage s by stage s+1's, the
last by the first's: planning/backups.py), so that a stage that loses every replica comes back as it
was instead of being rebuilt from its neighbours. For a model trained from scratch by the swarm
CheckFree's mix is the papers' answer; for a pretrained model it is no repair (one lost stage of
SmolLM2-135M rebuilt from its neighbour sent the loss from 2.89 to 18.5).

Each replica of a block stage keeps a chain of snapshots (`BackupSource`; shoal/train/backup_stream.py):
φ at each outer step (θ ← φ there, so φ is the whole stage; in a run without an outer optimizer, θ
every `backup_every` inner steps) and announces the latest one's version and digest in its signed
record. A keeper (`BackupKeeper`) pulls each new snapshot as an int8 change against the one it holds
(about 1.06 bytes a parameter, against 8 for θ and φ whole), or whole when it holds none of that
replica's chain, and checks what it rebuilt against the digest. A node taking a block stage with no
live replica restores the freshest kept snapshot whose digest matches what the stage announced
(`restore_from_backup`), with a fresh inner optimizer at the schedule's rate, so NoLoCo's catch-up
starts from the stage's own slow weights; where no keeper is left it falls back to the run's rule.

What a restore cannot check: once the records of the stage's replicas have expired (a TTL after they
died), a keeper's snapshot has nothing left to be held to; it is then taken as "unchecked", after
every checked one, and the line that announces the restore says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.utils import get_dht_time

from shoal.config import RunConfig
from shoal.node.averaging.base import epoch_steps
from shoal.node.compute import BACKWARD
from shoal.node.engine import Repair
from shoal.node.rpcs import EngineRpcs
from shoal.node.stage.copy import StageHolder, adopt_stage
from shoal.node.stage.kept_copies import active_replicas, stage_reference
from shoal.p2p.streams import FramedStream, read_reply
from shoal.p2p.transport import Transport
from shoal.planning.backups import KEPT_CHANGES, backup_keepers
from shoal.planning.swarm_view import STATE_ACTIVE, BackupNote
from shoal.protocol.pipeline import Ack, BackupPull, BackupSnapshot
from shoal.protocol.tensors import TensorSpec
from shoal.train.backup_stream import (
    BadBackup,
    Snapshot,
    apply_changes,
    change_specs,
    first_snapshot,
    next_snapshot,
    verdict,
    whole_snapshot,
)
from shoal.train.inner import InnerOptimizer
from shoal.train.outer import check_partner_tensors, counters_refusal

logger = logging.getLogger(__name__)

POLL_S = 0.5


@dataclass(frozen=True)
class Chain:
    """A replica's latest snapshot and the last changes that led to it, oldest first, each with the
    digest of the snapshot it starts from."""

    latest: Snapshot
    changes: tuple[tuple[str, list[torch.Tensor]], ...] = ()

    def since(self, digest: str) -> list[list[torch.Tensor]] | None:
        """The changes from the snapshot of this digest to the latest (None: not one we can bridge)."""
        starts = [start for start, _ in self.changes]
        if not digest or digest not in starts:
            return None
        return [pieces for _, pieces in self.changes[starts.index(digest) :]]


class BackupSource:
    """On a block-stage replica: its chain of snapshots, taken at each backup point, for its keepers."""

    def __init__(self, worker: StageHolder, every: int) -> None:
        self.worker, self.every = worker, every
        self.chain: Chain | None = None
        self.snapshots = self.changes_served = self.wholes_served = self.bytes_served = 0

    def due(self) -> tuple[int, int] | None:
        """The backup point (inner step, outer epoch) not yet taken, if one is due."""
        latest = self.chain.latest if self.chain is not None else None
        averager = self.worker.averager
        if averager is not None:
            taken = latest is not None and latest.outer_epoch >= averager.epoch
            if averager.stepping or averager.epoch == 0 or taken:
                return None
            return averager.epoch * averager.config.inner_steps, averager.epoch
        step = self.worker.optimizer.step_count
        if step == 0 or (latest is not None and step < latest.inner_step + self.every):
            return None
        return step, 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            point = self.due()
            if point is None:
                continue
            try:
                await self.take(*point)
            except Exception as e:  # the next backup point tries again; training goes on either way
                logger.warning("[%s] could not take a backup snapshot of stage %d: %s", self.worker.ctx.short_id,
                               self.worker.stage, e)  # fmt: skip

    async def take(self, inner_step: int, outer_epoch: int) -> None:
        """Snapshot the stage at this backup point (φ between outer steps, else θ between compute jobs)."""
        worker = self.worker
        averager = worker.averager
        if averager is not None:
            # φ as it is (no copy on a CPU): an outer step replaces the state's tensors, it never writes them
            weights = [p.detach().to("cpu", torch.float32) for p in averager.state.phi]
            if averager.stepping or averager.epoch != outer_epoch:
                return  # an outer step began while we looked: the next poll takes the next point
        else:
            weights = await worker.compute(_host_copy, worker.module, priority=BACKWARD)
            inner_step = worker.optimizer.step_count
        chain = self.chain
        if chain is None:
            self.chain = Chain(first_snapshot(weights, inner_step, outer_epoch))
        else:
            latest, change = await asyncio.to_thread(next_snapshot, chain.latest, weights, inner_step, outer_epoch)
            self.chain = Chain(latest, (*chain.changes, (chain.latest.digest, change))[-KEPT_CHANGES:])
        self.snapshots += 1
        await worker.ctx.publish()  # the record announces it now: keepers pull changes, not a stale version

    def note(self) -> BackupNote | None:
        latest = self.chain.latest if self.chain is not None else None
        if latest is None:
            return None
        return BackupNote(latest.version, latest.inner_step, latest.outer_epoch, latest.digest)

    async def serve(self, request: BackupPull, stream: FramedStream) -> None:
        """The latest snapshot: its change alone where the asker holds the one before it, else whole."""
        chain = self.chain
        if chain is None:
            await stream.write_message(Ack(accepted=False, reason="no snapshot of this stage taken yet"))
            return
        changes = chain.since(request.have)
        await stream.write_message(Ack(accepted=True))
        self.bytes_served += await write_snapshot(stream, self.worker.ctx.peer_id, chain.latest, changes)
        if changes is not None:
            self.changes_served += 1
        else:
            self.wholes_served += 1

    def stats(self) -> dict[str, Any]:
        latest = self.chain.latest if self.chain is not None else None
        return {
            "snapshots": self.snapshots,
            "version": latest.version if latest is not None else None,
            "changes_served": self.changes_served,
            "wholes_served": self.wholes_served,
            "bytes_served": self.bytes_served,
            "bytes_held": (latest.nbytes + sum(p.numel() * p.element_size() for _, c in self.chain.changes for p in c))
            if latest is not None and self.chain is not None
            else 0,
        }


class BackupKeeper:
    """On a worker: keeps the latest snapshot of neighbouring block stage `stage` from one replica's chain."""

    def __init__(self, worker: StageHolder, stage: int) -> None:
        self.worker, self.stage = worker, stage
        self.snapshot: Snapshot | None = None
        self.source: str | None = None  # the replica whose chain we follow
        self.changes = self.wholes = self.failures = self.refused = self.served = self.bytes_fetched = 0
        self._reference: list[torch.Tensor] | None = None

    @property
    def reference(self) -> list[torch.Tensor]:
        if self._reference is None:
            self._reference = stage_reference(self.worker.ctx.run, self.stage)
        return self._reference

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.refresh()

    def _choose(self) -> tuple[str, BackupNote] | None:
        """Whose chain to follow now: ours while its replica lives, else the most trained announced one;
        None where we hold what it announces."""
        view, me = self.worker.ctx.view, self.worker.ctx.peer_id
        if view is None:
            return None
        announced = {n.peer_id: n.backup for n in view.replicas(self.stage)
                     if n.state == STATE_ACTIVE and n.peer_id != me and n.backup is not None}  # fmt: skip
        if self.source in announced:
            note, held = announced[self.source], self.snapshot
            if held is None or note.version > held.version:
                return self.source, note
            if note.version == held.version and note.digest != held.digest:  # not what it announced: start over
                self.snapshot = None
                return self.source, note
            return None  # what it announces, or newer (its record lags our last pull)
        if not announced:
            return None
        peer = max(announced, key=lambda p: announced[p].inner_step)
        return peer, announced[peer]

    async def refresh(self) -> bool:
        """Follow the chosen replica's chain to its announced snapshot; whether we took a new one."""
        chosen = self._choose()
        if chosen is None:
            return False
        peer, note = chosen
        ctx = self.worker.ctx
        held = self.snapshot if peer == self.source else None
        try:
            source, snapshot, nbytes, changes = await pull_snapshot(ctx.transport, peer, self.stage, self.reference,
                                                                    ctx.config.network.rpc_timeout_s, held,
                                                                    ctx.run)  # fmt: skip
            if source != peer:
                raise BadBackup(f"a replica's snapshot of {source[-8:]}'s chain, not its own")
            if snapshot.version == note.version and snapshot.digest != note.digest:
                raise BadBackup(f"not the snapshot {peer[-8:]} announced at version {note.version}")
        except BadBackup as e:
            self.refused += 1
            logger.warning("[%s] backup of stage %d from %s refused: %s", ctx.short_id, self.stage, peer[-8:], e)
            return False
        except Exception as e:
            self.failures += 1
            logger.info("[%s] could not pull stage %d's backup from %s: %s", ctx.short_id, self.stage, peer[-8:], e)
            return False
        if self.snapshot is None:
            logger.info("[%s] backup: keeping stage %d's snapshots (from %s, inner step %d), each as its change",
                        ctx.short_id, self.stage, peer[-8:], snapshot.inner_step)  # fmt: skip
        if changes:
            self.changes += 1
        else:
            self.wholes += 1
        self.snapshot, self.source = snapshot, peer
        self.bytes_fetched += nbytes
        return True

    async def take_from(self, peer: str) -> bool:
        """A joiner's first snapshot: the one kept by the replica it copied its own stage from, so that a
        backup outlives its keepers' restarts while one replica of the keeping stage lives."""
        ctx = self.worker.ctx
        try:
            timeout_s = ctx.config.network.rpc_timeout_s
            source, snapshot, nbytes, _ = await pull_snapshot(ctx.transport, peer, self.stage, self.reference,
                                                              timeout_s, None, ctx.run)  # fmt: skip
        except Exception as e:
            logger.info("[%s] backup: %s kept no snapshot of stage %d for us: %s", ctx.short_id, peer[-8:],
                        self.stage, e)  # fmt: skip
            return False
        self.snapshot, self.source = snapshot, source
        self.wholes += 1
        self.bytes_fetched += nbytes
        logger.info("[%s] backup: took over the snapshot of stage %d that %s keeps (inner step %d)", ctx.short_id,
                    self.stage, peer[-8:], snapshot.inner_step)  # fmt: skip
        return True

    async def serve(self, stream: FramedStream) -> None:
        """Hand the kept snapshot on whole (a node restoring the stage, or a joiner of ours)."""
        snapshot, source = self.snapshot, self.source
        if snapshot is None or source is None:
            await stream.write_message(Ack(accepted=False, reason=f"no snapshot of stage {self.stage} kept here yet"))
            return
        await stream.write_message(Ack(accepted=True))
        await write_snapshot(stream, source, snapshot, None)
        self.served += 1

    def stats(self) -> dict[str, Any]:
        snapshot = self.snapshot
        return {
            "stage": self.stage,
            "changes": self.changes,
            "wholes": self.wholes,
            "failures": self.failures,
            "refused": self.refused,
            "served": self.served,
            "bytes_fetched": self.bytes_fetched,
            "bytes_held": snapshot.nbytes if snapshot is not None else 0,
            "inner_step": snapshot.inner_step if snapshot is not None else None,
            "version": snapshot.version if snapshot is not None else None,
            "source": self.source,
        }


async def write_snapshot(stream: FramedStream, source: str, snapshot: Snapshot, changes: list | None) -> int:
    """The header, then each change's pieces in order (`changes`) or the snapshot's tensors whole;
    returns the bytes."""
    header = BackupSnapshot(source=source, inner_step=snapshot.inner_step, outer_epoch=snapshot.outer_epoch,
                            version=snapshot.version, digest=snapshot.digest, tensors=len(snapshot.tensors),
                            changes=len(changes) if changes is not None else 0)  # fmt: skip
    await stream.write_message(header)
    sent = 0
    if changes is not None:
        for piece in (piece for change in changes for piece in change):
            sent += await stream.write_exact(piece, "int8" if piece.dtype == torch.int8 else "float32", kind="copy")
    else:
        for tensor in snapshot.tensors:
            sent += await stream.write_tensor(tensor, "float32", kind="copy")
    return sent


async def pull_snapshot(
    transport: Transport,
    peer: str,
    stage: int,
    reference: list[torch.Tensor],
    timeout_s: float,
    held: Snapshot | None,
    run: RunConfig,
) -> tuple[str, Snapshot, int, int]:
    """`peer`'s snapshot of `stage` (its own chain's latest, or the one it keeps), as a change to `held`
    where it sends changes; returns whose chain it is, the snapshot checked against its digest, the
    bytes read, and how many changes came (0: the snapshot whole). Raises BadBackup, BadTensor, or
    RuntimeError with the peer's refusal."""
    stream = await EngineRpcs(transport).backup_pull.open(peer, timeout_s)
    try:
        await stream.write_message(BackupPull(stage=stage, have=held.digest if held is not None else ""))
        ack = await read_reply(stream, Ack)
        if not ack.accepted:
            raise RuntimeError(ack.reason)
        header = await read_reply(stream, BackupSnapshot)
        steps = run.train.steps
        why = counters_refusal(header.inner_step, header.outer_epoch, steps, epoch_steps(run.averaging, stage))
        if why is not None:
            raise BadBackup(f"a snapshot at {why}")
        if header.tensors != len(reference):
            raise BadBackup(f"a snapshot of {header.tensors} tensors, expected {len(reference)}")
        if header.changes:
            if held is None:
                raise BadBackup("a change sent to a keeper that holds no snapshot")
            changes, nbytes = [], 0
            for _ in range(header.changes):
                pieces = []
                for want in change_specs([tuple(t.shape) for t in reference]):
                    spec = TensorSpec(want.dtype, want.shape, want.max_abs)
                    pieces.append(await stream.read_exact(spec, max_bytes=max(1, want.nbytes)))
                    nbytes += want.nbytes
                changes.append(pieces)
            snapshot = await asyncio.to_thread(apply_changes, held, changes, header.inner_step, header.outer_epoch,
                                               header.version, header.digest)  # fmt: skip
        else:
            tensors = []
            for like in reference:
                spec = TensorSpec("float32", tuple(like.shape))
                tensors.append(await stream.read_tensor(spec, max_bytes=like.numel() * 4))
            check_partner_tensors(tensors, reference, "backup snapshot", dtype=torch.float32)
            nbytes = sum(t.numel() * 4 for t in tensors)
            snapshot = await asyncio.to_thread(whole_snapshot, tensors, header.inner_step, header.outer_epoch,
                                               header.version, header.digest)  # fmt: skip
    finally:
        stream.close()
    return header.source, snapshot, nbytes, header.changes


async def restore_from_backup(worker: StageHolder, dead: Collection[str] = ()) -> Repair | None:
    """A block stage with no live replica: take it back from the freshest snapshot its keepers hold that
    matches what the stage announced (or, none matching, the freshest unchecked one), with a fresh
    inner optimizer at the schedule's rate; returns the repair for our record (None: no keeper held a
    snapshot, and the caller rebuilds the stage by the run's rule, saying so)."""
    ctx, run = worker.ctx, worker.ctx.run
    started = time.monotonic()
    stages = backup_keepers(run.pipeline.stages, worker.stage)
    keepers = active_replicas(worker, stages, dead)
    # the stage's own announcements, its dead replicas' included while their records live
    listed = ctx.listed_view
    announced = {n.peer_id: n.backup for n in listed.replicas(worker.stage) if n.backup is not None} if listed else {}
    reference = [p.detach().to("cpu") for p in worker.module.parameters()]
    found = []
    for keeper in keepers:
        try:
            source, snapshot, _, _ = await pull_snapshot(ctx.transport, keeper.peer_id, worker.stage, reference,
                                                         ctx.config.network.rpc_timeout_s, None, run)  # fmt: skip
        except Exception as e:
            logger.info("[%s] no backup of stage %d from %s: %s", ctx.short_id, worker.stage, keeper.peer_id[-8:], e)
            continue
        why = verdict(source, snapshot, announced)
        if why not in (None, "unverified"):
            logger.warning("[%s] stage %d's backup from %s refused: %s", ctx.short_id, worker.stage,
                           keeper.peer_id[-8:], why)  # fmt: skip
            continue
        found.append((why is None, snapshot.inner_step, keeper, source, snapshot))
    if not found:
        logger.warning("[%s] stage %d: no backup of it left (keepers: stage(s) %s, %d live): falling back to %s",
                       ctx.short_id, worker.stage, stages, len(keepers), run.repair.rule)  # fmt: skip
        return None
    checked, _, keeper, source, snapshot = max(found, key=lambda f: (f[0], f[1]))
    worker.optimizer = InnerOptimizer(worker.module, run.optim, run.train.steps)
    weights = list(snapshot.tensors)
    await adopt_stage(worker, weights, weights, snapshot.inner_step, snapshot.outer_epoch)
    seconds = time.monotonic() - started
    check = (f"checked against the digest {source[-8:]} announced" if checked
             else f"unchecked: no record of {source[-8:]} at that version is left")  # fmt: skip
    logger.warning("[%s] stage %d had no replica left: restored from the backup stage %d's %s keeps (inner step %d, "
                   "outer epoch %d; %s) in %.2f s", ctx.short_id, worker.stage, keeper.stage, keeper.peer_id[-8:],
                   snapshot.inner_step, snapshot.outer_epoch, check, seconds)  # fmt: skip
    return Repair(stage=worker.stage, rule="backup", sources=[keeper.stage], inner_step=snapshot.inner_step,
                  seconds=seconds, at=float(get_dht_time()), note=f"the backup {keeper.peer_id[-8:]} kept")  # fmt: skip


def _host_copy(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float32, copy=True) for p in module.parameters()]
