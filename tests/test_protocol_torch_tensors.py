"""torch tensors through tensor frames: exact round trips, and refusal of bad tensors.

Run: .venv/bin/python -m pytest tests/test_protocol_torch_tensors.py -q
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shoal.protocol import BadTensor, TensorHeader, TensorMeta, TensorSpec, assemble, decode, encode
from shoal.protocol.tensors import frame_payload
from shoal.protocol.torch_tensors import TORCH_DTYPES, frames_to_tensor, tensor_to_frames

CHUNK = 64  # small chunks, so a tiny tensor still crosses several of them

# The same number of bits as each wire dtype, to compare floats bit for bit (-0.0, subnormals).
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5, 9)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        x = (torch.randn(shape, generator=gen) * 100).to(dtype)
        x.view(-1)[:4] = torch.tensor([-0.0, 0.0, torch.finfo(dtype).tiny / 2, torch.finfo(dtype).max])
        return x
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)
    x.view(-1)[:2] = torch.tensor([info.min, info.max])
    return x


def _send_and_receive(
    t: torch.Tensor, wire: str, spec: TensorSpec | None = None, compute: torch.dtype | None = None
) -> torch.Tensor:
    header, chunks = tensor_to_frames(t, wire, chunk_bytes=CHUNK)
    header = decode(encode(header), TensorHeader)  # the header crosses the wire too
    spec = spec or TensorSpec(wire, tuple(header.meta.shape))
    payload = assemble(header, [bytes(c) for c in chunks], spec, chunk_bytes=CHUNK)
    return frames_to_tensor(header.meta, payload, spec, compute_dtype=compute)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS.get(a.dtype)
    return torch.equal(a.view(bits), b.view(bits)) if bits else torch.equal(a, b)


@pytest.mark.parametrize("wire", sorted(TORCH_DTYPES))
def test_each_dtype_round_trips_exactly(wire: str) -> None:
    t = _sample(TORCH_DTYPES[wire])
    back = _send_and_receive(t, wire)
    assert _same_bits(back, t)
    assert t.nbytes > 2 * CHUNK  # several chunks, really


def test_float32_sent_as_bfloat16_arrives_as_the_rounded_float32() -> None:
    t = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))  # (B, T, C)
    back = _send_and_receive(t, "bfloat16", TensorSpec("bfloat16", (None, 8, 16)), compute=torch.float32)
    assert back.dtype == torch.float32
    assert _same_bits(back, t.to(torch.bfloat16).to(torch.float32))


def test_strided_scalar_empty_and_grad_tensors_round_trip() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert _same_bits(_send_and_receive(base.t(), "float32"), base.t().contiguous())  # non-contiguous
    assert _same_bits(_send_and_receive(base[:, ::2], "float32"), base[:, ::2].contiguous())
    assert _same_bits(_send_and_receive(torch.tensor(3.5), "float32"), torch.tensor(3.5))  # rank 0
    assert _send_and_receive(torch.empty(0, 6), "float16").shape == (0, 6)
    w = torch.ones(2, 3, requires_grad=True) * 2
    assert _same_bits(_send_and_receive(w, "float32"), torch.full((2, 3), 2.0))


def test_the_result_owns_its_memory() -> None:
    t = torch.arange(6, dtype=torch.float32)
    header, chunks = tensor_to_frames(t, "float32")
    spec = TensorSpec("float32", (6,))
    writable = bytearray(b"".join(chunks))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frombuffer warns on read-only buffers: we must not hit that
        kept = frames_to_tensor(header.meta, writable, spec, compute_dtype=None)
        from_bytes = frames_to_tensor(header.meta, bytes(writable), spec, compute_dtype=None)
    writable[:] = bytes(len(writable))
    assert torch.equal(kept, t) and torch.equal(from_bytes, t)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_received_nan_and_inf_are_refused(wire: str, bad: float) -> None:
    raw = torch.tensor([1.0, bad, 2.0]).to(TORCH_DTYPES[wire])
    meta = TensorMeta(wire, (3,))
    payload = raw.view(torch.uint8).numpy().tobytes()  # as a peer that skipped the check would send it
    with pytest.raises(BadTensor, match="NaN or Inf"):
        frames_to_tensor(meta, payload, TensorSpec(wire, (None,)))


def test_the_sender_refuses_nan_and_a_cast_that_overflows() -> None:
    with pytest.raises(BadTensor, match="NaN or Inf"):
        tensor_to_frames(torch.tensor([0.0, float("nan")]), "float32")
    with pytest.raises(BadTensor, match="as float16"):
        tensor_to_frames(torch.tensor([1e6]), "float16")  # finite in fp32, inf in fp16


def test_wrong_dtype_or_shape_is_refused() -> None:
    header, chunks = tensor_to_frames(torch.zeros(2, 128, 64), "bfloat16")
    payload = b"".join(chunks)
    with pytest.raises(BadTensor, match="shape"):
        frames_to_tensor(header.meta, payload, TensorSpec("bfloat16", (None, 128, 128)))
    with pytest.raises(BadTensor, match="dtype"):
        frames_to_tensor(header.meta, payload, TensorSpec("float32", (None, 128, 64)))


def test_oversized_and_truncated_payloads_are_refused() -> None:
    header, chunks = tensor_to_frames(torch.zeros(4, 8), "float32")
    payload = b"".join(chunks)
    spec = TensorSpec("float32", (None, 8))
    with pytest.raises(BadTensor, match="over the limit of 64"):
        frames_to_tensor(header.meta, payload, spec, max_bytes=64)
    with pytest.raises(BadTensor, match="payload has 127"):
        frames_to_tensor(header.meta, payload[:-1], spec)
    with pytest.raises(BadTensor, match="payload has 129"):
        frames_to_tensor(header.meta, payload + b"\x00", spec)
    header, chunks = frame_payload(header.meta, payload, CHUNK)
    with pytest.raises(BadTensor, match="truncated"):
        assemble(header, chunks[:-1], spec, chunk_bytes=CHUNK)


def test_float_and_integer_kinds_do_not_cross_and_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError):
        tensor_to_frames(torch.ones(2), "int64")
    with pytest.raises(ValueError):
        tensor_to_frames(torch.ones(2, dtype=torch.int64), "float32")
    with pytest.raises(ValueError):
        tensor_to_frames(torch.ones(2), "float64")
