from __future__ import annotations

import torch

from shoal.config import DataConfig
from shoal.model.tokenizer import cached_tokenizer, train_tokenizer
from shoal.train.data import BatchSampler, load_token_splits, split_tokens, tokenize_text, validation_batches
from tests.helpers.tiny import sample_text

TEXT = sample_text(20000)


def test_bpe_tokenizer_round_trips_and_compresses():
    tokenizer = train_tokenizer(TEXT, 400)
    assert tokenizer.get_vocab_size() <= 400
    sample = "the swarm trains one model together"
    ids = tokenizer.encode(sample).ids
    assert tokenizer.decode(ids) == sample
    assert len(ids) < len(sample) / 2  # merges learned: well under one token per byte


def test_tokenizer_is_cached_atomically(tmp_path):
    first = cached_tokenizer(TEXT, 300, tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    second = cached_tokenizer(TEXT, 300, tmp_path)
    assert first.encode(TEXT[:500]).ids == second.encode(TEXT[:500]).ids


def test_shards_are_disjoint_and_cover_the_windows():
    tokens = torch.arange(10_001)
    seq_len, shards = 10, 3
    seen = []
    for shard in range(shards):
        sampler = BatchSampler(tokens, seq_len, batch_size=5, seed=0, shard=shard, num_shards=shards)
        starts = {int(x[0]) for step in range(len(sampler.windows) // 5) for x in sampler.batch(step)[0]}
        assert len(starts) == (len(sampler.windows) // 5) * 5  # no repeats within an epoch
        seen.append(starts)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_batches_are_deterministic_and_targets_shift_by_one():
    tokens = torch.arange(5_000)
    a = BatchSampler(tokens, 16, 4, seed=9)
    b = BatchSampler(tokens, 16, 4, seed=9)
    c = BatchSampler(tokens, 16, 4, seed=10)
    xa, ya = a.batch(7)
    xb, yb = b.batch(7)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(xa, c.batch(7)[0])


def test_validation_split_is_held_out_and_spread_over_the_corpus():
    tokens = torch.arange(200_000)
    train, val = split_tokens(tokens, 0.05)
    assert len(set(train.tolist()) & set(val.tolist())) == 0
    assert 0.03 < len(val) / len(tokens) < 0.07
    assert val.min() < 100_000 < val.max()
    assert len(list(validation_batches(val, 32, 4, 3))) == 3


def test_load_token_splits_from_a_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    splits = load_token_splits(DataConfig(path=str(path), val_fraction=0.1), vocab_size=300)
    assert len(splits.train) > 10 * len(splits.val) > 0
    assert 1.5 < splits.bytes_per_token < 10
    again = load_token_splits(DataConfig(path=str(path), val_fraction=0.1), vocab_size=300)  # from cache
    assert torch.equal(splits.train, again.train)
    assert torch.equal(tokenize_text(TEXT[:2000], 300)[:50], tokenize_text(TEXT[:2000], 300)[:50])
