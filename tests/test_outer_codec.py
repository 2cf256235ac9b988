"""The outer exchange's codecs (shoal/train/outer_codec.py): round trips within their stated bounds,
error feedback that loses nothing, and hostile pieces refused before they touch anything."""

from __future__ import annotations

import pytest
import torch

from shoal.config import ConfigError
from shoal.protocol.errors import BadTensor
from shoal.run_files import load_run_config
from shoal.train.outer_codec import BLOCK, CHUNK, LEVELS, MAX_SCALE, OuterCodec, int8_blocks, topk_chunks

SHAPES = [(352, 128), (128,), (2 * CHUNK + 5,), (3,)]


def _tensors(seed: int = 0, scale: float = 0.02) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


@pytest.mark.parametrize("name", ["float32", "int8", "topk"])
def test_pieces_match_the_specs_a_receiver_reads_by(name):
    codec = OuterCodec(name)
    phi, delta = _tensors(0), _tensors(1, 1e-3)
    pieces, _, _ = codec.encode_delta(delta, None)
    phi_pieces = codec.encode_phi(phi)
    assert [(str(p.dtype)[6:], tuple(p.shape)) for p in phi_pieces] == [
        (s.dtype, s.shape) for s in codec.phi_specs(SHAPES)
    ]
    assert [(str(p.dtype)[6:], tuple(p.shape)) for p in pieces] == [
        (s.dtype, s.shape) for s in codec.delta_specs(SHAPES)
    ]
    assert sum(p.numel() * p.element_size() for p in phi_pieces + pieces) == codec.bytes_per_exchange(SHAPES)


def test_int8_blocks_round_trip_within_half_a_level_of_each_blocks_absmax():
    codec = OuterCodec("int8")
    for x, y in zip(_tensors(), codec.decode_phi(codec.encode_phi(_tensors()), SHAPES), strict=True):
        flat = torch.zeros(-(-x.numel() // BLOCK) * BLOCK)
        flat[: x.numel()] = x.reshape(-1)
        bound = flat.view(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK)[: x.numel()] / (2 * LEVELS)
        assert bool(((y - x).reshape(-1).abs() <= bound * 1.0001 + 1e-12).all())


def test_topk_sends_each_chunks_largest_and_its_error_feedback_loses_nothing():
    codec = OuterCodec("topk", topk_fraction=0.02)
    deltas = [_tensors(seed, 1e-3) for seed in range(5)]
    error, sent_total = None, [torch.zeros(s) for s in SHAPES]
    for delta in deltas:
        _, sent, error = codec.encode_delta(delta, error)
        for total, s in zip(sent_total, sent, strict=True):
            total += s
    # what went plus what is still owed is exactly what the replica's Δs summed to
    for k in range(len(SHAPES)):
        owed = sum(d[k] for d in deltas)
        assert torch.allclose(sent_total[k] + error[k], owed, atol=1e-7)
    big = _tensors(7, 1.0)[0]
    _, sent, _ = codec.encode_delta([big], None)
    kept = sent[0].reshape(-1) != 0
    assert int(kept.sum()) == codec.k_per_chunk(big.numel()) * -(-big.numel() // CHUNK)
    chunk = big.reshape(-1)[:CHUNK].abs()
    assert chunk[kept[:CHUNK]].min() >= chunk[~kept[:CHUNK]].max()  # the largest, not any


def _hostile(pieces: list[torch.Tensor], k: int, change) -> list[torch.Tensor]:
    pieces = [p.clone() for p in pieces]
    change(pieces[k])
    return pieces


@pytest.mark.parametrize(
    ("piece", "change", "why"),
    [
        (2, lambda s: s.__setitem__(0, float("inf")), "scale"),
        (2, lambda s: s.__setitem__(0, -1.0), "scale"),
        (2, lambda s: s.__setitem__(0, 10 * MAX_SCALE), "scale"),
        (1, lambda v: v.__setitem__((0, 0), -128), "outside"),
        (0, lambda i: i.__setitem__((0, 0), CHUNK), "outside a chunk"),
        (0, lambda i: i.__setitem__((0, 1), int(i[0, 0])), "twice"),
    ],
)
def test_hostile_topk_pieces_are_refused(piece, change, why):
    codec = OuterCodec("topk")
    shape = (2 * CHUNK,)
    pieces, _, _ = codec.encode_delta([torch.randn(shape)], None)
    with pytest.raises(BadTensor, match=why):
        codec.decode_delta(_hostile(pieces, piece, change), [shape])


def test_hostile_int8_pieces_and_wrong_shapes_are_refused():
    codec = OuterCodec("int8")
    scales, values = int8_blocks(torch.randn(100))
    with pytest.raises(BadTensor, match="padding"):
        bad = values.clone()
        bad[-1, -1] = 5  # 100 values in 2 blocks of 64: the last 28 are padding
        codec.decode_phi([scales, bad], [(100,)])
    with pytest.raises(BadTensor, match="values"):
        codec.decode_phi([scales, values[:1]], [(100,)])
    with pytest.raises(BadTensor, match="scales"):
        codec.decode_phi([scales[:, None], values], [(100,)])
    indices, vals, sc = topk_chunks(torch.randn(50), 2)
    with pytest.raises(BadTensor):
        OuterCodec("topk").decode_delta([indices[0], vals, sc], [(50,)])  # a rank short


def test_the_run_config_chooses_the_codec_and_refuses_topk_under_an_all_reduce(tmp_path):
    base = load_run_config("tiny")
    assert base.averaging.codec == "topk"  # the bundled runs' choice (benchmarks/compression.py)
    path = tmp_path / "run.toml"
    text = base.to_toml()
    path.write_text(text.replace('codec = "topk"', 'codec = "int8"'))
    int8 = load_run_config(str(path))
    assert int8.averaging.codec == "int8" and int8.run_id != base.run_id
    path.write_text(text.replace('mode = "noloco"', 'mode = "diloco"'))
    with pytest.raises(ConfigError, match="averaging.codec"):
        load_run_config(str(path))
    path.write_text(text.replace('codec = "topk"', 'codec = "zip"'))
    with pytest.raises(ConfigError, match="averaging.codec"):
        load_run_config(str(path))
