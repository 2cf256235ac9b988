"""Tensor frames: how activations and gradients cross the wire, without torch.

A tensor travels as one ``TensorHeader`` message (dtype, shape, total bytes, number of chunks)
followed by that many raw chunks of at most ``CHUNK_BYTES`` each: every chunk full except the last.
Bytes are the tensor's little-endian C-contiguous memory. The receiver says what it expects with a
``TensorSpec`` and feeds what arrives to a ``TensorAssembler``, which refuses anything that does not
match *before* it allocates or copies: a peer cannot make us hold more than ``max_bytes``.

    assembler = TensorAssembler(TensorSpec("bfloat16", (None, 128, 128)))  # (B free, T, C)
    assembler.begin(decode(first_message, TensorHeader))
    for chunk in rest:
        assembler.add(chunk)
    payload = assembler.finish()   # exactly header.nbytes (bytes or bytearray)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from .errors import BadTensor, quote
from .limits import CHUNK_BYTES, MAX_TENSOR_BYTES, MAX_TENSOR_DIM, MAX_TENSOR_RANK
from .registry import message
from .schema import wire_field

DTYPE_SIZES: Mapping[str, int] = MappingProxyType(
    {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1}
)
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
# A wire dtype that is a codec, not a plain dtype: `int8` sends a float32 scale per row (the last
# dimension's absolute maximum) and then the rows as int8 in [-127, 127], as SWARM sends activations.
QUANTIZED_DTYPES = frozenset({"int8"})
INT8_LEVELS = 127

Buffer = bytes | bytearray | memoryview


def wire_nbytes(shape: tuple[int, ...], wire_dtype: str) -> int:
    """Bytes a tensor of `shape` takes on the wire as `wire_dtype`, an int8 codec's scales included."""
    count = 1
    for dim in shape:
        count *= dim
    if wire_dtype in QUANTIZED_DTYPES:
        rows = count // shape[-1] if shape and shape[-1] else 0
        return count * DTYPE_SIZES[wire_dtype] + rows * DTYPE_SIZES["float32"]
    return count * DTYPE_SIZES[wire_dtype]


def _shape_text(shape: tuple[int | None, ...]) -> str:
    dims = ["*" if dim is None else str(dim) for dim in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """A tensor's wire dtype and shape; checked on construction, so a decoded one is always sane."""

    dtype: str = wire_field(max_len=16)
    shape: tuple[int, ...] = wire_field(max_len=MAX_TENSOR_RANK)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise BadTensor(f"dtype {quote(self.dtype)} is not one of {', '.join(DTYPE_SIZES)}")
        shape = tuple(self.shape)  # accepts torch.Size or a list locally; stores a plain tuple
        if len(shape) > MAX_TENSOR_RANK:
            raise BadTensor(f"rank {len(shape)} exceeds the limit of {MAX_TENSOR_RANK}")
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= MAX_TENSOR_DIM:
                raise BadTensor(f"shape dimensions must be ints in [0, {MAX_TENSOR_DIM}]")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def describe(self) -> str:
        return f"{self.dtype} {_shape_text(self.shape)}"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a receiver accepts: one dtype, a shape where ``None`` marks a free dimension, and (for
    floats) optionally a bound on magnitude: a finite 3e38 would pass a finiteness check, then
    overflow the first sum of squares it meets (a gradient norm), so receivers bound what they take."""

    dtype: str
    shape: tuple[int | None, ...]
    max_abs: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        shape = tuple(self.shape)
        if len(shape) > MAX_TENSOR_RANK or not all(
            dim is None or (type(dim) is int and 0 <= dim <= MAX_TENSOR_DIM) for dim in shape
        ):
            raise ValueError(f"spec shape {shape!r} must be ints in [0, {MAX_TENSOR_DIM}] or None")
        object.__setattr__(self, "shape", shape)

    def check(self, meta: TensorMeta) -> None:
        """Raise ``BadTensor`` unless ``meta`` has this dtype and a matching shape."""
        if meta.dtype != self.dtype:
            raise BadTensor(f"dtype {meta.dtype} does not match the expected {self.dtype}")
        if len(meta.shape) != len(self.shape) or any(
            want is not None and want != got for want, got in zip(self.shape, meta.shape, strict=True)
        ):
            raise BadTensor(f"shape {_shape_text(meta.shape)} does not match the expected {_shape_text(self.shape)}")


@message("tensor")
class TensorHeader:
    """Announces a tensor: its meta, its size in bytes and how many raw chunks follow."""

    meta: TensorMeta
    nbytes: int
    num_chunks: int


def chunk_count(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many chunks carry ``nbytes``: all full but the last; zero for an empty tensor."""
    return -(-nbytes // chunk_bytes)


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def split_payload(data: Buffer, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """Cut a payload into zero-copy chunks of ``chunk_bytes`` (the last may be shorter)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    view = _byte_view(data)
    return [view[start : start + chunk_bytes] for start in range(0, view.nbytes, chunk_bytes)]


def frame_payload(
    meta: TensorMeta, data: Buffer, chunk_bytes: int = CHUNK_BYTES
) -> tuple[TensorHeader, list[memoryview]]:
    """The header and chunks that send ``data`` (the raw bytes of a tensor described by ``meta``)."""
    view = _byte_view(data)
    if view.nbytes != meta.nbytes:
        raise ValueError(f"{meta.describe()} is {meta.nbytes} bytes, but the payload has {view.nbytes}")
    header = TensorHeader(meta=meta, nbytes=meta.nbytes, num_chunks=chunk_count(meta.nbytes, chunk_bytes))
    return header, split_payload(view, chunk_bytes)


class TensorAssembler:
    """Receives one tensor: a header, then its chunks, refusing anything that does not match.

    Every check happens before the bytes it guards are stored; the buffer is allocated only once the
    header has passed, and never exceeds ``max_bytes``. A tensor that arrives as one immutable chunk
    (``bytes``, as a stream reader hands it over: an activation under ``CHUNK_BYTES``) is kept as it
    is rather than copied: a fresh buffer costs a copy and its page faults, about 1 ms per MiB here.
    """

    def __init__(self, spec: TensorSpec, max_bytes: int = MAX_TENSOR_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        if not 0 <= max_bytes <= MAX_TENSOR_BYTES:
            raise ValueError(f"max_bytes must be in [0, MAX_TENSOR_BYTES={MAX_TENSOR_BYTES}], not {max_bytes}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.spec = spec
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.header: TensorHeader | None = None
        self._buffer: bytearray | None = None
        self._whole: bytes | None = None  # the one immutable chunk of a single-chunk tensor
        self._received = 0
        self._chunks = 0
        self._finished = False

    @property
    def meta(self) -> TensorMeta | None:
        return None if self.header is None else self.header.meta

    @property
    def done(self) -> bool:
        """True once every declared byte has arrived."""
        return self.header is not None and self._received == self.header.nbytes

    def begin(self, header: TensorHeader) -> None:
        """Check the header against the spec and the limits; allocate the buffer."""
        if not isinstance(header, TensorHeader):
            raise TypeError(f"begin() takes a TensorHeader, not {type(header).__name__}")
        if self.header is not None:
            raise BadTensor("a second header arrived for the same tensor")
        meta = header.meta
        self.spec.check(meta)
        if meta.nbytes > self.max_bytes:
            raise BadTensor(f"{meta.describe()} is {meta.nbytes} bytes, over the limit of {self.max_bytes}")
        if header.nbytes != meta.nbytes:
            raise BadTensor(f"header declares {header.nbytes} bytes, but {meta.describe()} is {meta.nbytes}")
        expected_chunks = chunk_count(meta.nbytes, self.chunk_bytes)
        if header.num_chunks != expected_chunks:
            raise BadTensor(
                f"header declares {header.num_chunks} chunks; {meta.nbytes} bytes "
                f"in chunks of {self.chunk_bytes} are {expected_chunks}"
            )
        self.header = header
        if header.num_chunks != 1:  # a single chunk may be kept as it arrives (see add)
            self._buffer = bytearray(meta.nbytes)

    def add(self, chunk: Buffer) -> bool:
        """Store the next chunk; return ``done``. Refuses extra, oversized or misplaced chunks."""
        header = self.header
        if header is None:
            raise BadTensor("a tensor chunk arrived before its header")
        if self._finished or self._chunks >= header.num_chunks:
            raise BadTensor(f"too many chunks: the header declared {header.num_chunks}")
        view = _byte_view(chunk)
        size = view.nbytes
        if not 0 < size <= self.chunk_bytes:
            raise BadTensor(f"a chunk of {size} bytes; chunks hold 1 to {self.chunk_bytes} bytes")
        if self._received + size > header.nbytes:
            raise BadTensor(
                f"chunk {self._chunks + 1} goes past the declared total of {header.nbytes} bytes "
                f"({self._received} + {size})"
            )
        if header.num_chunks == 1 and size == header.nbytes and isinstance(chunk, bytes):
            self._whole = chunk  # immutable: nobody can change it under us, so no copy
        else:
            if self._buffer is None:
                self._buffer = bytearray(header.nbytes)
            self._buffer[self._received : self._received + size] = view
        self._received += size
        self._chunks += 1
        if self._chunks == header.num_chunks and not self.done:
            raise BadTensor(self._truncated_text())
        return self.done

    def finish(self) -> bytes | bytearray:
        """The complete payload (exactly ``header.nbytes``); ``BadTensor`` if anything is missing.
        A ``bytes`` payload is the received chunk itself; a ``bytearray`` is this assembler's own."""
        if self.header is None:
            raise BadTensor("the tensor's header never arrived")
        if not self.done:
            raise BadTensor(self._truncated_text())
        self._finished = True
        if self._whole is not None:
            return self._whole
        assert self._buffer is not None, "a complete tensor has its bytes"
        return self._buffer

    def _truncated_text(self) -> str:
        assert self.header is not None
        return (
            f"truncated tensor: {self._received} of {self.header.nbytes} bytes "
            f"in {self._chunks} of {self.header.num_chunks} chunks"
        )


def assemble(
    header: TensorHeader,
    chunks: Iterable[Buffer],
    spec: TensorSpec,
    max_bytes: int = MAX_TENSOR_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
) -> bytes | bytearray:
    """One-shot ``TensorAssembler``: the payload of a header and all its chunks."""
    assembler = TensorAssembler(spec, max_bytes=max_bytes, chunk_bytes=chunk_bytes)
    assembler.begin(header)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()
