"""What a NoLoCo exchange puts on the wire: φ and Δ as float32, as int8 blocks, or Δ as a sparse top-k.

The outer update (outer.py) takes the decoded tensors; this module only turns a replica's φ and Δ
into wire pieces and back, strictly, so a hostile partner's pieces are refused before they touch
anything. `[averaging] codec` chooses, per run:

- `float32`: φ and Δ as they are (8 bytes a parameter each way). Both sides of a pair compute
  bit-identical means.
- `int8`: φ and Δ in blocks of 64 values, a float32 absmax scale per block and the values in
  [-127, 127] (1.06 bytes a value). Δ carries error feedback (below).
- `topk`: φ as int8 blocks; Δ in chunks of 4,096 values, of which only the `topk_fraction` largest
  by magnitude go (int32 index, int8 value, a float32 scale per chunk; SparseLoCo's chunked top-k with
  error feedback, at 8 bits where SparseLoCo uses 2).

Error feedback: what a replica's compressed Δ left out is kept (`error`) and added to its next Δ
before compressing, so no direction is lost, only delayed. The replica's own outer step uses its Δ
as the partner decodes it, so both members of a pair apply the same mean Δ; it keeps its own φ
exact. The error is the replica's own (it does not depend on the partner), so a change of partner
does not reset it; a replica that starts afresh (a join, a restart) starts with none.

    codec = OuterCodec("topk", topk_fraction=0.02)
    pieces, sent, error = codec.encode_delta(delta, error)    # sent: Δ as the partner will decode it
    theirs = codec.decode_delta(received_pieces, shapes)        # raises BadTensor on a bad piece
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.protocol.errors import BadTensor

BLOCK = 64  # values per int8 scale
CHUNK = 4096  # values per top-k chunk (SparseLoCo's)
LEVELS = 127
MAX_SCALE = 1e6  # a block's absmax beyond this is not a weight or a weight's change: refused

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PieceSpec:
    """One wire piece a receiver expects: its dtype and exact shape (float pieces bounded by `max_abs`)."""

    dtype: str
    shape: Shape
    max_abs: float | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES[self.dtype]


@dataclass(frozen=True)
class TensorCodec:
    """One way to put one tensor on the wire: the pieces a receiver expects, encoding, strict decoding.
    `k` is the top-k count per chunk where the codec takes one (the others ignore it)."""

    specs: Callable[[Shape, int], list[PieceSpec]]
    encode: Callable[[torch.Tensor, int], list[torch.Tensor]]
    decode: Callable[[Sequence[torch.Tensor], Shape], torch.Tensor]

    @property
    def pieces(self) -> int:
        return len(self.specs((1,), 1))


EXACT = TensorCodec(
    specs=lambda shape, k: [PieceSpec("float32", shape)],
    encode=lambda x, k: [x.detach().float()],
    decode=lambda pieces, shape: pieces[0].float(),
)
INT8_BLOCKS = TensorCodec(
    specs=lambda shape, k: _int8_specs(shape),
    encode=lambda x, k: int8_blocks(x),
    decode=lambda pieces, shape: from_int8_blocks(*pieces, shape),
)
TOPK_CHUNKS = TensorCodec(
    specs=lambda shape, k: _topk_specs(shape, k),
    encode=lambda x, k: topk_chunks(x, k),
    decode=lambda pieces, shape: from_topk_chunks(*pieces, shape),
)
# `[averaging] codec` -> how φ and how Δ travel (OUTER_CODECS in shoal/config.py names the same; a test
# holds them equal)
OUTER_CODEC_TABLE: dict[str, tuple[TensorCodec, TensorCodec]] = {
    "float32": (EXACT, EXACT),
    "int8": (INT8_BLOCKS, INT8_BLOCKS),
    "topk": (INT8_BLOCKS, TOPK_CHUNKS),
}


@dataclass(frozen=True)
class OuterCodec:
    name: str = "float32"
    topk_fraction: float = 0.02

    def __post_init__(self) -> None:
        if self.name not in OUTER_CODEC_TABLE:
            raise ValueError(f"outer codec must be one of {', '.join(OUTER_CODEC_TABLE)}, got {self.name!r}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"topk_fraction must be in (0, 1], got {self.topk_fraction}")

    @property
    def exact(self) -> bool:
        return OUTER_CODEC_TABLE[self.name][1] is EXACT

    @property
    def _phi(self) -> TensorCodec:
        return OUTER_CODEC_TABLE[self.name][0]

    @property
    def _delta(self) -> TensorCodec:
        return OUTER_CODEC_TABLE[self.name][1]

    # ---- what goes -------------------------------------------------------------------------------

    def encode_phi(self, phi: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [piece for p in phi for piece in self._phi.encode(p, 0)]

    def encode_delta(
        self, delta: Sequence[torch.Tensor], error: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """The wire pieces of Δ (+ the error fed back), Δ as the partner decodes them, and the new error."""
        if self.exact:
            return [d.detach().float() for d in delta], [d.detach().float() for d in delta], None
        pieces, sent, left = [], [], []
        for k, d in enumerate(delta):
            target = d.detach().float() + (error[k] if error is not None else 0.0)
            parts = self._delta.encode(target, self.k_per_chunk(d.numel()))
            decoded = self._delta.decode(parts, tuple(d.shape))
            pieces += parts
            sent.append(decoded)
            left.append(target - decoded)
        return pieces, sent, left

    # ---- what comes ------------------------------------------------------------------------------

    def phi_specs(self, shapes: Sequence[Shape]) -> list[PieceSpec]:
        return [spec for s in shapes for spec in self._phi.specs(s, 0)]

    def delta_specs(self, shapes: Sequence[Shape]) -> list[PieceSpec]:
        return [spec for s in shapes for spec in self._delta.specs(s, self.k_per_chunk(math.prod(s)))]

    def decode_phi(self, pieces: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return _decode(self._phi, pieces, shapes)

    def decode_delta(self, pieces: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return _decode(self._delta, pieces, shapes)

    def k_per_chunk(self, numel: int) -> int:
        return max(1, math.ceil(self.topk_fraction * min(CHUNK, max(1, numel))))

    def bytes_per_exchange(self, shapes: Sequence[Shape]) -> int:
        """What one side sends in one exchange (φ and Δ), by the specs."""
        return sum(s.nbytes for s in self.phi_specs(shapes) + self.delta_specs(shapes))


def _decode(codec: TensorCodec, pieces: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
    n = codec.pieces
    return [codec.decode(pieces[n * k : n * k + n], s) for k, s in enumerate(shapes)]


_ITEM_BYTES = {"float32": 4, "int32": 4, "int8": 1}


# ---- int8 blocks -----------------------------------------------------------------------------------


def _blocks(numel: int) -> int:
    return max(1, math.ceil(numel / BLOCK))


def _int8_specs(shape: Shape) -> list[PieceSpec]:
    n = _blocks(math.prod(shape))
    return [PieceSpec("float32", (n,), MAX_SCALE), PieceSpec("int8", (n, BLOCK))]


def int8_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """[scales (n,), values (n, 64)]: each block of 64 values (zero-padded) over its absmax, x127."""
    flat = x.detach().float().reshape(-1)
    padded = torch.zeros(_blocks(flat.numel()) * BLOCK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    rows = padded.view(-1, BLOCK)
    scales = rows.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(rows / safe[:, None] * LEVELS).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return [scales, values]


def from_int8_blocks(scales: torch.Tensor, values: torch.Tensor, shape: Shape) -> torch.Tensor:
    numel = math.prod(shape)
    _check_scales(scales, "int8 blocks")
    if values.dtype != torch.int8 or tuple(values.shape) != (_blocks(numel), BLOCK):
        raise BadTensor(f"int8 blocks: values {tuple(values.shape)} {values.dtype} for a tensor of {shape}")
    _check_levels(values, "int8 blocks")
    flat = (values.float() * (scales.float()[:, None] / LEVELS)).reshape(-1)
    if bool((flat[numel:] != 0).any()):
        raise BadTensor("int8 blocks: a value in the padding past the tensor's end")
    return flat[:numel].reshape(shape).clone()


# ---- top-k chunks ----------------------------------------------------------------------------------


def _chunks(numel: int) -> int:
    return max(1, math.ceil(numel / CHUNK))


def _chunk_len(numel: int) -> int:
    return min(CHUNK, max(1, numel))


def _topk_specs(shape: Shape, k: int) -> list[PieceSpec]:
    n = _chunks(math.prod(shape))
    return [PieceSpec("int32", (n, k)), PieceSpec("int8", (n, k)), PieceSpec("float32", (n,), MAX_SCALE)]


def topk_chunks(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    """[indices (n, k) int32, values (n, k) int8, scales (n,)]: in each chunk of a tensor's values, the
    k largest by magnitude, quantised over the chunk's largest. Padding is never chosen: it is ranked
    below every real value, and k never exceeds a chunk's real values (k_per_chunk caps it)."""
    flat = x.detach().float().reshape(-1)
    numel, length = flat.numel(), _chunk_len(flat.numel())
    padded = torch.zeros(_chunks(numel) * length, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    rows = padded.view(-1, length)
    rank = rows.abs()
    rank.view(-1)[numel:] = -1.0
    real = numel - (rows.shape[0] - 1) * length  # values in the last chunk
    k_last = min(k, real)
    top = rank.topk(k, dim=1).indices
    if k_last < k:  # the last chunk has fewer real values than k: repeat its smallest real choice
        top[-1, k_last:] = top[-1, k_last - 1]
    picked = rows.gather(1, top)
    scales = picked.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(picked / safe[:, None] * LEVELS).clamp_(-LEVELS, LEVELS).to(torch.int8)
    if k_last < k:
        values[-1, k_last:] = 0
    return [top.to(torch.int32), values, scales]


def from_topk_chunks(indices: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, shape: Shape) -> torch.Tensor:
    numel = math.prod(shape)
    n, length = _chunks(numel), _chunk_len(numel)
    _check_scales(scales, "top-k")
    if indices.dtype != torch.int32 or values.dtype != torch.int8 or indices.shape != values.shape:
        raise BadTensor(f"top-k: indices {tuple(indices.shape)} {indices.dtype}, values {tuple(values.shape)}")
    if indices.dim() != 2 or indices.shape[0] != n or scales.shape[0] != n:
        raise BadTensor(f"top-k: {tuple(indices.shape)} chunks for a tensor of {shape} ({n} chunks)")
    _check_levels(values, "top-k")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= length):
        raise BadTensor(f"top-k: an index outside a chunk of {length}")
    flat_index = (indices.long() + torch.arange(n, device=indices.device)[:, None] * length).reshape(-1)
    decoded = (values.float() * (scales.float()[:, None] / LEVELS)).reshape(-1)
    beyond = flat_index >= numel
    if bool((decoded[beyond] != 0).any()):
        raise BadTensor("top-k: a value at an index past the tensor's end")
    keep = ~beyond
    flat_index, decoded = flat_index[keep], decoded[keep]
    nonzero = decoded != 0
    if flat_index[nonzero].unique().numel() != int(nonzero.sum()):
        raise BadTensor("top-k: an index chosen twice")
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[flat_index[nonzero]] = decoded[nonzero]
    return out.reshape(shape)


def _check_scales(scales: torch.Tensor, what: str) -> None:
    if scales.dtype != torch.float32 or scales.dim() != 1:
        raise BadTensor(f"{what}: scales {tuple(scales.shape)} {scales.dtype}")
    if scales.numel() and not (bool(torch.isfinite(scales).all()) and float(scales.min()) >= 0.0):
        raise BadTensor(f"{what}: a scale that is negative or not finite")
    if scales.numel() and float(scales.max()) > MAX_SCALE:
        raise BadTensor(f"{what}: a scale over {MAX_SCALE:g}")


def _check_levels(values: torch.Tensor, what: str) -> None:
    if values.numel() and int(values.min()) < -LEVELS:
        raise BadTensor(f"{what}: a value of {-LEVELS - 1}, outside [-{LEVELS}, {LEVELS}]")
