"""torch tensors to and from tensor frames: the one protocol module that imports torch.

Kept apart (nothing in ``shoal.protocol`` imports it) so the protocol stays importable without
torch. Sending casts to the wire dtype and ships the tensor's raw bytes; receiving rebuilds from
bytes with ``torch.frombuffer``, refuses NaN/Inf, and casts to the compute dtype.

    header, chunks = tensor_to_frames(activation, "bfloat16")          # (B, T, C)
    ... send encode(header), then each chunk ...
    payload = assemble(header, received_chunks, spec)
    x = frames_to_tensor(header.meta, payload, spec)                    # float32 (B, T, C)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import MappingProxyType

import torch

from .errors import BadTensor
from .limits import CHUNK_BYTES, MAX_TENSOR_BYTES
from .pipeline import token_id_bytes
from .tensors import FLOAT_DTYPES, INT8_LEVELS, Buffer, TensorHeader, TensorMeta, TensorSpec, frame_payload

# Frames carry little-endian bytes; torch.frombuffer reads native order, so refuse to pretend.
if sys.byteorder != "little":
    raise ImportError("shoal tensor frames are little-endian; big-endian hosts are not supported")

TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "int8": torch.int8,
    }
)


def _torch_dtype(wire_dtype: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[wire_dtype]
    except KeyError:
        raise ValueError(f"wire dtype {wire_dtype!r} is not one of {', '.join(TORCH_DTYPES)}") from None


def all_finite(x: torch.Tensor, max_abs: float | None = None) -> bool:
    """No NaN or Inf in `x` (and, given `max_abs`, no value beyond it). One min/max pass (NaN
    propagates through both) is ~10x cheaper than materialising `isfinite(x)` and reducing it, which
    cost 1 ms per MiB on the hot path of every hop."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    if max_abs is not None:
        return bool((low >= -max_abs) & (high <= max_abs))  # NaN compares false
    return bool(torch.isfinite(low) & torch.isfinite(high))


def tensor_to_frames(
    t: torch.Tensor, wire_dtype: str, chunk_bytes: int = CHUNK_BYTES
) -> tuple[TensorHeader, list[memoryview]]:
    """The header and raw chunks that send ``t`` as ``wire_dtype``.

    Casts on CPU and makes the tensor contiguous; when ``t`` already is a contiguous CPU tensor of the
    wire dtype, the chunks are views of its memory: do not modify it in place until they are sent.
    Refuses NaN/Inf (``BadTensor``): a peer would refuse them anyway, and a cast to float16 that
    overflows is better caught here, where it happened. Float and integer tensors do not cross kinds.
    """
    target = _torch_dtype(wire_dtype)
    if t.is_floating_point() != (wire_dtype in FLOAT_DTYPES) or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"will not send a {t.dtype} tensor as {wire_dtype}")
    x = t.detach().to(device="cpu", dtype=target).contiguous()
    if wire_dtype in FLOAT_DTYPES and not all_finite(x):
        raise BadTensor(f"tensor has NaN or Inf values as {wire_dtype}")
    meta = TensorMeta(dtype=wire_dtype, shape=tuple(x.shape))
    # A flat uint8 view gives the raw bytes for every dtype, bfloat16 included (numpy has no bf16).
    raw = x.reshape(-1).view(torch.uint8).numpy()
    return frame_payload(meta, memoryview(raw), chunk_bytes)


def frames_to_tensor(
    meta: TensorMeta,
    payload: Buffer,
    spec: TensorSpec,
    compute_dtype: torch.dtype | None = torch.float32,
    max_bytes: int = MAX_TENSOR_BYTES,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Rebuild a received tensor, checked against ``spec``, size and finiteness.

    The result owns its memory (``payload`` can be reused or released). ``compute_dtype=None`` keeps
    the wire dtype. On an accelerator ``device``, the checked bytes are copied there once, straight
    from the received buffer.
    """
    spec.check(meta)
    if meta.nbytes > max_bytes:
        raise BadTensor(f"{meta.describe()} is {meta.nbytes} bytes, over the limit of {max_bytes}")
    view = memoryview(payload).cast("B")
    if view.nbytes != meta.nbytes:
        raise BadTensor(f"{meta.describe()} is {meta.nbytes} bytes, but the payload has {view.nbytes}")
    wire = TORCH_DTYPES[meta.dtype]
    if meta.numel == 0:
        x, owned = torch.empty(meta.shape, dtype=wire), True
    else:
        # frombuffer shares memory and warns on read-only buffers: copy those once here, and
        # clone writable ones below, so the tensor never aliases the caller's buffer.
        owned = view.readonly
        buffer = bytearray(view) if owned else view
        x = torch.frombuffer(buffer, dtype=wire, count=meta.numel).view(meta.shape)
    if meta.dtype in FLOAT_DTYPES and not all_finite(x, spec.max_abs):
        bound = "" if spec.max_abs is None else f" or values beyond ±{spec.max_abs:g}"
        raise BadTensor(f"{meta.describe()} has NaN or Inf values{bound}")
    if device is not None and device.type != "cpu":
        return x.to(device=device, dtype=compute_dtype or wire)
    if compute_dtype is not None and compute_dtype != wire:
        return x.to(compute_dtype)
    return x if owned else x.clone()


# ---- int8 rows: a float32 scale per row, then the rows in [-127, 127] ----------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, values): each row's (last dimension's) absolute maximum as float32 (shape x.shape[:-1]),
    and the row divided by it, times 127, rounded to int8. Zero rows get scale 0 and values 0."""
    x = x.detach().float()
    scales = x.abs().amax(dim=-1)
    values = torch.round(x * (INT8_LEVELS / scales.clamp_min(1e-30)).unsqueeze(-1)).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return scales, values.to(torch.int8)


def dequantize_rows(scales: torch.Tensor, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rows back, each within half a step (its scale / 254) of what was quantized."""
    return (values.to(dtype) * (scales.to(dtype) / INT8_LEVELS).unsqueeze(-1)).to(dtype)


def round_trip_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a receiver of its int8 rows rebuilds it (the local trainer's model of an int8 hop)."""
    return dequantize_rows(*quantize_rows(x), dtype=x.dtype)


def rows_scale_spec(spec: TensorSpec) -> TensorSpec:
    """What the scales of an int8 tensor matching `spec` must look like: float32, one per row, each in
    [0, spec.max_abs] (a row's absolute maximum is bounded as the raw values would be)."""
    return TensorSpec("float32", spec.shape[:-1], spec.max_abs)


def rows_values_spec(spec: TensorSpec, scales: torch.Tensor) -> TensorSpec:
    """The int8 values that go with `scales`: exactly one row of spec's width per scale."""
    return TensorSpec("int8", (*scales.shape, spec.shape[-1]))


def rows_to_tensor(
    scales: torch.Tensor, values: torch.Tensor, compute_dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """Rebuild an int8-rows tensor whose frames passed their specs, after the checks those cannot make:
    no negative scale, no -128 (the quantizer never sends either)."""
    if scales.numel() and bool((scales < 0).any()):
        raise BadTensor("int8 rows: a negative scale")
    if values.numel() and bool((values == -INT8_LEVELS - 1).any()):
        raise BadTensor(f"int8 rows: a value of {-INT8_LEVELS - 1}, outside [-{INT8_LEVELS}, {INT8_LEVELS}]")
    if device is not None and device.type != "cpu":
        scales, values = scales.to(device), values.to(device)
    return dequantize_rows(scales, values, compute_dtype)


# ---- token ids beside a Subspace Network's coefficients ------------------------------------------------


def pack_tokens(tokens: torch.Tensor, vocab_size: int) -> bytes:
    """A microbatch's token ids (B, T) as they travel in a request's `tokens` field."""
    ids = tokens.detach().to("cpu", torch.int64).reshape(-1)
    width = token_id_bytes(vocab_size)
    little_endian = torch.stack([(ids >> (8 * i)) & 0xFF for i in range(width)], dim=1).to(torch.uint8)
    return little_endian.contiguous().numpy().tobytes()


def unpack_tokens(data: bytes, shape: tuple[int, int], vocab_size: int) -> torch.Tensor:
    """The ids `pack_tokens` wrote, as int64 of `shape` (the coefficients' batch and length); raises
    BadTensor unless there are exactly that many and each is an id of the vocabulary."""
    width = token_id_bytes(vocab_size)
    count = shape[0] * shape[1]
    if len(data) != count * width:
        raise BadTensor(f"token ids: {len(data)} bytes where {shape[0]} x {shape[1]} ids take {count * width}")
    if not count:
        return torch.zeros(shape, dtype=torch.int64)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(count, width).to(torch.int64)
    ids = sum(raw[:, i] << (8 * i) for i in range(width)).view(shape)
    if ids.numel() and bool((ids >= vocab_size).any()):
        raise BadTensor(f"token ids: an id outside the vocabulary of {vocab_size}")
    return ids
