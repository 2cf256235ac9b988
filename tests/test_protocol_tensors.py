"""Tensor frames without torch: TensorMeta, TensorSpec, split_payload and the TensorAssembler.

Run: .venv/bin/python -m pytest tests/test_protocol_tensors.py -q
Small chunk sizes stand in for CHUNK_BYTES so no test moves megabytes.
"""

from __future__ import annotations

import array
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.protocol import (
    CHUNK_BYTES,
    MAX_TENSOR_BYTES,
    BadTensor,
    ProtocolError,
    TensorAssembler,
    TensorHeader,
    TensorMeta,
    TensorSpec,
    assemble,
    chunk_count,
    decode,
    encode,
    frame_payload,
    split_payload,
)
from shoal.protocol.limits import MAX_TENSOR_DIM

SPEC = TensorSpec("float32", (None, 4))  # (B free, C)
CHUNK = 8


def _frames(rows: int = 3, chunk_bytes: int = CHUNK) -> tuple[bytes, TensorHeader, list[memoryview]]:
    payload = bytes(range(rows * 16))
    header, chunks = frame_payload(TensorMeta("float32", (rows, 4)), payload, chunk_bytes)
    return payload, header, chunks


def _assembler(max_bytes: int = MAX_TENSOR_BYTES) -> TensorAssembler:
    return TensorAssembler(SPEC, max_bytes=max_bytes, chunk_bytes=CHUNK)


# ---------------------------------------------------------------- TensorMeta and TensorSpec


@pytest.mark.parametrize(
    ("dtype", "size"), [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int64", 8), ("int32", 4)]
)
def test_meta_nbytes_is_dtype_size_times_elements(dtype: str, size: int) -> None:
    assert TensorMeta(dtype, (2, 3, 5)).nbytes == 30 * size
    assert TensorMeta(dtype, ()).nbytes == size  # a scalar
    assert TensorMeta(dtype, (0, 7)).nbytes == 0


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("float64", (1,)),
        ("uint8", (1,)),
        ("float32", (-1,)),
        ("float32", (True,)),
        ("float32", (1.0,)),
        ("float32", (MAX_TENSOR_DIM + 1,)),
        ("float32", (1,) * 9),
    ],
)
def test_meta_refuses_bad_dtypes_and_shapes(dtype: str, shape: tuple) -> None:
    with pytest.raises(BadTensor):
        TensorMeta(dtype, shape)


def test_meta_normalizes_a_local_shape_to_a_plain_tuple() -> None:
    assert TensorMeta("int32", [2, 3]).shape == (2, 3)


def test_a_header_round_trips_and_a_bad_meta_from_a_peer_is_bad_tensor() -> None:
    _, header, _ = _frames()
    assert decode(encode(header), TensorHeader) == header
    with pytest.raises(BadTensor, match="float64"):
        decode(
            encode(header).replace(b"float32", b"float64"),  # same length: the wire stays well formed
            TensorHeader,
        )


def test_spec_matches_dtype_and_every_fixed_dimension() -> None:
    spec = TensorSpec("bfloat16", (None, 128, 128))
    spec.check(TensorMeta("bfloat16", (1, 128, 128)))
    spec.check(TensorMeta("bfloat16", (64, 128, 128)))
    for meta, reason in [
        (TensorMeta("float16", (1, 128, 128)), "dtype float16 does not match the expected bfloat16"),
        (
            TensorMeta("bfloat16", (1, 128, 64)),
            r"shape \(1, 128, 64\) does not match the expected \(\*, 128, 128\)",
        ),
        (TensorMeta("bfloat16", (1, 128)), "shape"),
        (TensorMeta("bfloat16", (1, 128, 128, 1)), "shape"),
    ]:
        with pytest.raises(BadTensor, match=reason):
            spec.check(meta)
    with pytest.raises(ValueError):
        TensorSpec("float64", (1,))
    with pytest.raises(ValueError):
        TensorSpec("float32", (-1,))


# ---------------------------------------------------------------- splitting


def test_split_payload_is_zero_copy_and_all_but_the_last_chunk_full() -> None:
    data = bytearray(range(20))
    chunks = split_payload(data, chunk_bytes=8)
    assert [c.nbytes for c in chunks] == [8, 8, 4]
    assert b"".join(chunks) == bytes(data)
    data[0] = 99
    assert chunks[0][0] == 99  # a view, not a copy
    assert split_payload(b"", chunk_bytes=8) == []
    assert len(split_payload(bytes(CHUNK_BYTES + 1))) == 2 == chunk_count(CHUNK_BYTES + 1)


def test_split_payload_reads_typed_buffers_as_bytes() -> None:
    floats = array.array("f", [1.0, 2.0, 3.0])
    assert b"".join(split_payload(floats, chunk_bytes=5)) == floats.tobytes()


def test_frame_payload_refuses_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(ValueError):
        frame_payload(TensorMeta("float32", (2,)), b"1234567")


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 6), st.integers(1, 40), st.data())
def test_frames_reassemble_exactly(rows: int, chunk_bytes: int, data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=rows * 16, max_size=rows * 16))
    header, chunks = frame_payload(TensorMeta("float32", (rows, 4)), payload, chunk_bytes)
    assert header.nbytes == len(payload) and header.num_chunks == len(chunks) == chunk_count(len(payload), chunk_bytes)
    out = assemble(decode(encode(header), TensorHeader), [bytes(c) for c in chunks], SPEC, chunk_bytes=chunk_bytes)
    assert out == payload


# ---------------------------------------------------------------- the assembler refuses


def test_assembler_reports_progress_and_completes() -> None:
    payload, header, chunks = _frames()
    assembler = _assembler()
    assembler.begin(header)
    assert assembler.meta == header.meta
    results = [assembler.add(chunk) for chunk in chunks]
    assert results == [False] * (len(chunks) - 1) + [True]
    assert assembler.finish() == payload


def test_a_tensor_in_one_immutable_chunk_is_kept_as_it_arrived_and_a_mutable_one_is_copied() -> None:
    """A stream reader hands over `bytes`: nobody can change them under us, so no copy (1 ms per MiB)."""
    payload = bytes(range(16))
    header, _ = frame_payload(TensorMeta("float32", (1, 4)), payload, 64)
    whole = TensorAssembler(SPEC, chunk_bytes=64)
    whole.begin(header)
    assert whole.add(payload) and whole.finish() is payload
    mutable = bytearray(payload)
    copied = TensorAssembler(SPEC, chunk_bytes=64)
    copied.begin(header)
    assert copied.add(mutable) and copied.finish() == payload
    mutable[0] = 255  # the sender's buffer changes later: what was assembled does not
    assert copied.finish() == payload


def test_an_empty_tensor_needs_no_chunks() -> None:
    header, chunks = frame_payload(TensorMeta("float32", (0, 4)), b"", CHUNK)
    assert header.num_chunks == 0 and chunks == []
    assert assemble(header, [], SPEC, chunk_bytes=CHUNK) == b""


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (TensorHeader(TensorMeta("float16", (3, 4)), 24, 3), "dtype float16 does not match"),
        (
            TensorHeader(TensorMeta("float32", (3, 5)), 60, 8),
            r"shape \(3, 5\) does not match the expected \(\*, 4\)",
        ),
        (TensorHeader(TensorMeta("float32", (4,)), 16, 2), "shape"),
        (
            TensorHeader(TensorMeta("float32", (3, 4)), 47, 6),
            "declares 47 bytes, but float32 \\(3, 4\\) is 48",
        ),
        (TensorHeader(TensorMeta("float32", (3, 4)), -1, 6), "declares -1 bytes"),
        (TensorHeader(TensorMeta("float32", (3, 4)), 48, 7), "declares 7 chunks"),
        (TensorHeader(TensorMeta("float32", (3, 4)), 48, 5), "declares 5 chunks"),
        (TensorHeader(TensorMeta("float32", (3, 4)), 48, 0), "declares 0 chunks"),
    ],
)
def test_assembler_refuses_a_header_that_does_not_match(header: TensorHeader, reason: str) -> None:
    with pytest.raises(BadTensor, match=reason):
        _assembler().begin(header)


def test_assembler_refuses_a_tensor_over_its_max_before_allocating() -> None:
    _, header, _ = _frames(rows=3)
    with pytest.raises(BadTensor, match="48 bytes, over the limit of 47"):
        _assembler(max_bytes=47).begin(header)
    # Over MAX_TENSOR_BYTES: refused without allocating the 256 MiB the header asks for.
    rows = MAX_TENSOR_BYTES // 16 + 1
    huge = TensorHeader(TensorMeta("float32", (rows, 4)), rows * 16, chunk_count(rows * 16))
    tracemalloc.start()
    try:
        with pytest.raises(BadTensor, match="over the limit"):
            TensorAssembler(SPEC).begin(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(ValueError):
        TensorAssembler(SPEC, max_bytes=MAX_TENSOR_BYTES + 1)


def test_assembler_refuses_a_chunk_past_the_declared_total() -> None:
    header, chunks = frame_payload(TensorMeta("float32", (3,)), bytes(12), CHUNK)  # chunks of 8 + 4
    assembler = TensorAssembler(TensorSpec("float32", (None,)), chunk_bytes=CHUNK)
    assembler.begin(header)
    assembler.add(chunks[0])
    with pytest.raises(BadTensor, match=r"chunk 2 goes past the declared total of 12 bytes \(8 \+ 8\)"):
        assembler.add(b"12345678")


def test_assembler_refuses_too_many_chunks() -> None:
    _, header, chunks = _frames()
    assembler = _assembler()
    assembler.begin(header)
    for chunk in chunks:
        assembler.add(chunk)
    with pytest.raises(BadTensor, match="too many chunks: the header declared 6"):
        assembler.add(b"x")
    assembler.finish()
    with pytest.raises(BadTensor, match="too many chunks"):
        assembler.add(b"x")


def test_assembler_refuses_a_truncated_tensor() -> None:
    _, header, chunks = _frames()
    assembler = _assembler()
    assembler.begin(header)
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    with pytest.raises(BadTensor, match="truncated tensor: 40 of 48 bytes in 5 of 6 chunks"):
        assembler.finish()


def test_assembler_refuses_short_chunks_once_the_declared_count_is_used_up() -> None:
    _, header, chunks = _frames()
    assembler = _assembler()
    assembler.begin(header)
    for chunk in chunks[:-1]:
        assembler.add(chunk[:4])
    with pytest.raises(BadTensor, match="truncated tensor: 24 of 48 bytes in 6 of 6 chunks"):
        assembler.add(chunks[-1][:4])


@pytest.mark.parametrize(("chunk", "reason"), [(b"", "a chunk of 0 bytes"), (b"x" * (CHUNK + 1), "chunk of 9 bytes")])
def test_assembler_refuses_empty_and_oversized_chunks(chunk: bytes, reason: str) -> None:
    _, header, _ = _frames()
    assembler = _assembler()
    assembler.begin(header)
    with pytest.raises(BadTensor, match=reason):
        assembler.add(chunk)


def test_assembler_refuses_chunks_before_the_header_and_a_second_header() -> None:
    _, header, _ = _frames()
    assembler = _assembler()
    with pytest.raises(BadTensor, match="before its header"):
        assembler.add(b"x")
    with pytest.raises(BadTensor, match="never arrived"):
        assembler.finish()
    assembler.begin(header)
    with pytest.raises(BadTensor, match="second header"):
        assembler.begin(header)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=10), st.integers(0, 4))
def test_any_chunk_sequence_is_assembled_exactly_or_refused_as_bad_tensor(chunks: list[bytes], rows: int) -> None:
    header, _ = frame_payload(TensorMeta("float32", (rows, 4)), bytes(rows * 16), CHUNK)
    try:
        out = assemble(header, chunks, SPEC, chunk_bytes=CHUNK)
    except ProtocolError as error:
        assert isinstance(error, BadTensor)
        return
    assert out == b"".join(chunks) and len(out) == header.nbytes
