"""A node's state on disk (`shoal node --state-dir DIR`): what a restarted node resumes from.

    DIR/identity          the node's key, so its peer id survives a restart (shoal.dht.identity)
    DIR/manifest.json     format version, run, peer, stage, role, counters, and the tensor file's
                          name, size and SHA-256
    DIR/state-<hash>.pt   the tensors: the stage's weights θ, AdamW's state, and the outer
                          optimizer's slow weights φ and momentum where the node has them
    DIR/lock              held (a POSIX lock) by the node using DIR, so two nodes never share one identity

A save writes the tensors to a temporary file, fsyncs it and renames it to a name of its own, then
writes the manifest the same way, last: a node killed at any moment leaves the previous manifest and
the file it names intact, and a half-written file is never named by a manifest. Older tensor files
are removed only once the new manifest is in place. No pickle: the tensors are read with
`torch.load(weights_only=True)` (tensors and plain containers only), and only after their checksum
matched; the manifest is JSON.

`StateDir.load` checks everything before anything is used, and raises `StateRefused` naming the file
and why for a manifest of another format or version, run, model shape, stage count or peer, a tensor
file that is missing, truncated or fails its checksum, and tensors of the wrong count, shape or
dtype, or not finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.config import RunConfig
from shoal.errors import UsageError
from shoal.files import atomic_write, fsync_path
from shoal.node.config import STATE_IDENTITY
from shoal.protocol.errors import MalformedMessage
from shoal.protocol.schema import load_document, wire_field

FORMAT = "shoal-node-state"
FORMAT_VERSION = 2  # 2: weights of the Hugging Face rotary layout (protocol 8); a 1 holds another model
MANIFEST = "manifest.json"
IDENTITY = STATE_IDENTITY
LOCK = "lock"
TENSOR_FILE = re.compile(r"state-[0-9a-f]{16}\.pt")
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden")  # what parameter shapes depend on
CHUNK = 1 << 20


class StateRefused(UsageError):
    """Saved state this node will not use: `path` names the file, `why` says what is wrong with it."""

    def __init__(self, path: Path, why: str):
        self.path, self.why = path, why
        super().__init__(
            f"refusing the saved state {path}: {why}. Nothing was changed; to start this node fresh (keeping its "
            f"identity), remove {path.parent / MANIFEST} and {path.parent}/state-*.pt, or pass another --state-dir"
        )


@dataclass(frozen=True, eq=False)
class SavedState:
    """What a node keeps across a restart: its stage's tensors and its counters."""

    run_id: str
    peer_id: str
    stage: int
    role: str  # "data" or "worker"
    inner_step: int  # inner optimizer steps taken (a data node's next step: its data position)
    outer_epoch: int  # outer epochs taken (0 where the node does not average)
    lr_scale: float  # the inner optimizer's learning-rate scale (1.1 after a CheckFree repair)
    weights: tuple[torch.Tensor, ...]  # θ, in module.parameters() order
    inner: dict  # AdamW's state_dict: {"state": {index: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}
    phi: tuple[torch.Tensor, ...] | None = None  # outer slow weights, None where the node does not average
    momentum: tuple[torch.Tensor, ...] | None = None
    saved_at: float = 0.0  # unix time


@dataclass(frozen=True)
class StageShapes:
    """The parameter shapes of one stage: in parameters() order (θ, φ, momentum), and in the inner
    optimizer's order (AdamW numbers its state by parameter group: see InnerOptimizer)."""

    params: tuple[tuple[int, ...], ...]
    optimizer: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class TensorFile:
    """The manifest's description of the tensor file it names."""

    file: str = wire_field(pattern=TENSOR_FILE.pattern)
    bytes: int = wire_field(ge=0)
    sha256: str = wire_field(pattern="[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class SavedShape:
    """The model fields the parameter shapes depend on (SHAPE_FIELDS)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """DIR/manifest.json, read with the schema every shoal document is read with (protocol/schema.py)."""

    format: str = wire_field(choices=(FORMAT,))
    version: int = wire_field(choices=(FORMAT_VERSION,))
    run_id: str
    run_name: str
    stages: int
    model: SavedShape
    peer_id: str
    stage: int
    role: str = wire_field(choices=("data", "worker"))
    inner_step: int = wire_field(ge=0)
    outer_epoch: int = wire_field(ge=0)
    lr_scale: float  # finite: the schema refuses NaN and infinities
    saved_at: float
    tensors: TensorFile


def stage_shapes(run: RunConfig, stage: int) -> StageShapes:
    from shoal.model.stages import build_stage
    from shoal.train.inner import InnerOptimizer

    module = build_stage(run.model, run.pipeline.stages, stage, run.train.seed)
    groups = InnerOptimizer(module, run.optim, run.train.steps).adamw.param_groups
    return StageShapes(
        params=tuple(tuple(p.shape) for p in module.parameters()),
        optimizer=tuple(tuple(p.shape) for group in groups for p in group["params"]),
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# The lock files this process holds. A POSIX lock cannot refuse its own process, and closing any
# descriptor of the file drops it, so a second StateDir on the same folder is refused here first.
_HELD_LOCKS: set[Path] = set()


class StateDir:
    """One node's --state-dir: save and load its state, atomically and checked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._write_lock = threading.Lock()  # saves from the interval task and from shutdown never interleave
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def identity_path(self) -> Path:
        return self.path / IDENTITY

    # ---- owning the folder -----------------------------------------------------------------------

    def acquire(self) -> None:
        """Create DIR if needed and take its lock: a second node on the same DIR would share our peer id."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock_path = (self.path / LOCK).resolve()
            if lock_path in _HELD_LOCKS:
                raise UsageError(f"--state-dir {self.path} is in use by another node (pid {os.getpid()})")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise UsageError(f"--state-dir {self.path}: cannot use it ({e.strerror})") from None
        try:
            # lockf, not flock: a POSIX lock belongs to this process alone, so the DHT and averager
            # processes hivemind forks from the node do not inherit it and keep a killed node's
            # folder locked after it is gone
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(f"--state-dir {self.path} is in use by another node (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd, self._lock_path = fd, lock_path
        _HELD_LOCKS.add(lock_path)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            _HELD_LOCKS.discard(self._lock_path)
            self._lock_fd = None

    # ---- saving ----------------------------------------------------------------------------------

    def save(self, state: SavedState, run: RunConfig) -> Path:
        """Write `state` for `run`: the tensors first, then the manifest that names them; returns the
        tensor file. Blocking (file I/O and fsync): call it off the event loop."""
        with self._write_lock:
            name, size, digest = self.write_tensors(state)
            self.commit(self.manifest(state, run, name, size, digest))
            return self.path / name

    def write_tensors(self, state: SavedState) -> tuple[str, int, str]:
        """The first half of a save: the tensors under a name of their own (no manifest names it yet)."""
        payload = {
            "weights": list(state.weights),
            "inner": state.inner,
            "phi": None if state.phi is None else list(state.phi),
            "momentum": None if state.momentum is None else list(state.momentum),
        }
        tmp = self.path / f".state.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            digest = _sha256(tmp)
            name = f"state-{digest[:16]}.pt"
            size = tmp.stat().st_size
            os.replace(tmp, self.path / name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        fsync_path(self.path)
        return name, size, digest

    @staticmethod
    def manifest(state: SavedState, run: RunConfig, name: str, size: int, digest: str) -> Manifest:
        return Manifest(
            format=FORMAT,
            version=FORMAT_VERSION,
            run_id=state.run_id,
            run_name=run.name,
            stages=run.pipeline.stages,
            model=SavedShape(**{key: getattr(run.model, key) for key in SHAPE_FIELDS}),
            peer_id=state.peer_id,
            stage=state.stage,
            role=state.role,
            inner_step=state.inner_step,
            outer_epoch=state.outer_epoch,
            lr_scale=float(state.lr_scale),
            saved_at=float(state.saved_at or time.time()),
            tensors=TensorFile(file=name, bytes=size, sha256=digest),
        )

    def commit(self, manifest: Manifest) -> None:
        """The second half: replace the manifest (durably: fsynced before and after the rename), then
        drop the tensor files it no longer names."""
        atomic_write(self.manifest_path, json.dumps(dataclasses.asdict(manifest), indent=1), durable=True)
        for old in self.path.glob("state-*.pt"):
            if old.name != manifest.tensors.file:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()

    # ---- loading ---------------------------------------------------------------------------------

    def load(self, run: RunConfig, peer_id: str) -> SavedState | None:
        """The state saved here for this run and peer, checked; None if nothing was ever saved.
        Raises `StateRefused` (naming the file and why) for anything it will not use."""
        if not self.manifest_path.exists():
            return None
        manifest = self._read_manifest()
        tensors_path = self.path / manifest.tensors.file
        self._check_intact(tensors_path, manifest.tensors)  # intact first: then whether it is ours
        self._check_foreign(manifest, run, peer_id)
        payload = self._read_tensors(tensors_path)
        weights, inner, phi, momentum = _check_payload(payload, stage_shapes(run, manifest.stage), tensors_path)
        return SavedState(
            run_id=manifest.run_id,
            peer_id=manifest.peer_id,
            stage=manifest.stage,
            role=manifest.role,
            inner_step=manifest.inner_step,
            outer_epoch=manifest.outer_epoch,
            lr_scale=manifest.lr_scale,
            weights=weights,
            inner=inner,
            phi=phi,
            momentum=momentum,
            saved_at=manifest.saved_at,
        )

    def _read_manifest(self) -> Manifest:
        path = self.manifest_path
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise StateRefused(path, f"cannot be read ({e.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StateRefused(path, f"is not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StateRefused(path, "is not a shoal node state manifest")
        if data.get("version") != FORMAT_VERSION:
            raise StateRefused(path, f"has format version {data.get('version')!r}; this shoal reads {FORMAT_VERSION}")
        try:
            return load_document(Manifest, data)
        except MalformedMessage as e:
            raise StateRefused(path, f"has a missing or malformed {e.field!r}: {e.reason}") from None

    def _check_foreign(self, manifest: Manifest, run: RunConfig, peer_id: str) -> None:
        path = self.manifest_path
        if manifest.stages != run.pipeline.stages:
            raise StateRefused(
                path, f"was saved for a run of {manifest.stages} stages; run {run.name} has {run.pipeline.stages}"
            )
        differ = [f"{k} {getattr(manifest.model, k)!r} there, {getattr(run.model, k)!r} here" for k in SHAPE_FIELDS
                  if getattr(manifest.model, k) != getattr(run.model, k)]  # fmt: skip
        if differ:
            raise StateRefused(path, f"was saved for another model shape ({', '.join(differ)})")
        if manifest.run_id != run.run_id:
            raise StateRefused(
                path,
                f"was saved for run {manifest.run_name}@{manifest.run_id}; this node joins run {run.name}@{run.run_id}",
            )
        if manifest.peer_id != peer_id:
            raise StateRefused(
                path,
                f"was saved by peer {manifest.peer_id}, and this node is {peer_id} (its identity file is "
                "another one, or was replaced)",
            )
        if not 0 <= manifest.stage < run.pipeline.stages:
            raise StateRefused(path, f"holds stage {manifest.stage}, outside this run's 0..{run.pipeline.stages - 1}")

    def _check_intact(self, path: Path, described: TensorFile) -> None:
        try:
            size = path.stat().st_size
        except OSError as e:
            raise StateRefused(path, f"is named by {MANIFEST} but cannot be read ({e.strerror})") from None
        if size != described.bytes:
            raise StateRefused(path, f"is truncated or altered: {size} bytes, {described.bytes} were saved")
        if _sha256(path) != described.sha256:
            raise StateRefused(path, "does not match its checksum in the manifest (corrupt)")

    def _read_tensors(self, path: Path) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # the checksum matched, so this is a file we did not write
            raise StateRefused(path, f"cannot be read as plain tensors ({type(e).__name__}: {str(e)[:120]})") from None


def _check_payload(
    payload: Any, shapes: StageShapes, path: Path
) -> tuple[tuple[torch.Tensor, ...], dict, tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """Weights, AdamW state, φ and momentum from a loaded payload, each checked against `shapes`."""
    if not isinstance(payload, dict) or set(payload) != {"weights", "inner", "phi", "momentum"}:
        raise StateRefused(path, "does not hold weights, inner, phi and momentum")
    params = shapes.params
    weights = _tensor_list(payload["weights"], params, path, "weights")
    phi = None if payload["phi"] is None else _tensor_list(payload["phi"], params, path, "slow weights")
    momentum = None if payload["momentum"] is None else _tensor_list(payload["momentum"], params, path, "momentum")
    if (phi is None) != (momentum is None):
        raise StateRefused(path, "holds slow weights without momentum, or momentum without slow weights")
    return weights, _check_inner(payload["inner"], shapes.optimizer, path), phi, momentum


def _tensor_list(value: Any, shapes: Sequence[tuple[int, ...]], path: Path, what: str) -> tuple[torch.Tensor, ...]:
    if not isinstance(value, list) or len(value) != len(shapes):
        count = len(value) if isinstance(value, list) else "no list of"
        raise StateRefused(path, f"holds {count} {what} tensors; this stage of the model has {len(shapes)}")
    for i, (tensor, shape) in enumerate(zip(value, shapes, strict=True)):
        _check_tensor(tensor, shape, path, f"{what} tensor {i}")
    return tuple(value)


def _check_tensor(tensor: Any, shape: tuple[int, ...], path: Path, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise StateRefused(path, f"{what} is not a tensor")
    if tuple(tensor.shape) != tuple(shape):
        raise StateRefused(
            path, f"{what} has shape {tuple(tensor.shape)}; the model has {tuple(shape)} (another shape)"
        )
    if tensor.dtype != torch.float32:
        raise StateRefused(path, f"{what} is {tensor.dtype}, not float32")
    if not bool(torch.isfinite(tensor).all()):
        raise StateRefused(path, f"{what} holds NaN or infinite values")


def _check_inner(inner: Any, shapes: Sequence[tuple[int, ...]], path: Path) -> dict:
    """AdamW's state: a moment pair (and a step) per parameter it has seen, each of its parameter's shape.
    The parameter groups (hyper-parameters) are not taken from the file: the run's config sets them."""
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict):
        raise StateRefused(path, "holds no optimizer state")
    for index, entry in inner["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(shapes) or not isinstance(entry, dict):
            raise StateRefused(path, f"holds optimizer state for parameter {index!r}, which this stage does not have")
        if set(entry) != {"step", "exp_avg", "exp_avg_sq"}:
            raise StateRefused(path, f"holds optimizer state {sorted(entry)} for parameter {index}")
        step = entry["step"]
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not bool(torch.isfinite(step).all()):
            raise StateRefused(path, f"optimizer step of parameter {index} is not a finite number")
        for key in ("exp_avg", "exp_avg_sq"):
            _check_tensor(entry[key], shapes[index], path, f"optimizer {key} of parameter {index}")
    return {"state": inner["state"]}
