"""Token data: the corpus through the tokenizer, a held-out split, and seeded per-shard sampling.

The token stream is cut into blocks; every k-th block is held out for validation, so the
validation text is drawn from the whole corpus rather than from whichever book happens to be
last. Training windows are split round-robin into disjoint shards, one per data node, and each
shard is visited in a seeded random order, epoch by epoch: the same (seed, shard, step) always
gives the same batch, on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from shoal.config import DataConfig
from shoal.model.corpus import atomic_write_bytes, cache_dir, default_corpus_path, read_text
from shoal.model.llama import derive_seed
from shoal.model.tokenizer import cached_tokenizer, corpus_digest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

HOLDOUT_BLOCK_TOKENS = 4096


@dataclass(frozen=True)
class TokenSplits:
    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64
    source: str
    text_bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.text_bytes / max(1, len(self.train) + len(self.val))


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    period = max(2, round(1 / val_fraction))
    blocks = torch.arange(len(tokens)) // HOLDOUT_BLOCK_TOKENS
    is_val = blocks % period == period - 1
    if not bool(is_val.any()):  # a short text: hold out its tail instead
        is_val = torch.arange(len(tokens)) >= len(tokens) - max(1, int(len(tokens) * val_fraction))
    return tokens[~is_val].contiguous(), tokens[is_val].contiguous()


def tokenize_text(text: str, vocab_size: int, tokenizer_dir: Path | None = None) -> torch.Tensor:
    return encode_lines(cached_tokenizer(text, vocab_size, tokenizer_dir), text)


def encode_lines(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """The text's token ids, line by line, with no special tokens (a checkpoint's tokenizer would
    otherwise start every line with its BOS)."""
    lines = text.splitlines(keepends=True)
    ids = [i for encoding in tokenizer.encode_batch(lines, add_special_tokens=False) for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.int64)


def run_tokenizer(data: DataConfig, vocab_size: int, tokenizer_file: Path | None = None) -> Tokenizer:
    """The tokenizer a run's data is tokenized with: the checkpoint's `tokenizer.json` for a run
    imported from one, else a BPE trained once per corpus and cached."""
    if tokenizer_file is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_file))
    return cached_tokenizer(read_text(data.path or str(default_corpus_path())), vocab_size)


def load_token_splits(data: DataConfig, vocab_size: int, tokenizer_file: Path | None = None) -> TokenSplits:
    """Tokens of the configured corpus (default: the Debian texts), cached next to the tokenizer;
    `tokenizer_file`: the run's checkpoint's tokenizer (see `run_tokenizer`)."""
    source = data.path or str(default_corpus_path())
    text = read_text(source)
    if tokenizer_file is None:
        cache = cache_dir() / f"tokens-{corpus_digest(text)}-{vocab_size}.npy"
    else:
        tokenizer_id = corpus_digest(Path(tokenizer_file).read_text(encoding="utf-8"))
        cache = cache_dir() / f"tokens-{corpus_digest(text)}-hf{tokenizer_id}-{vocab_size}.npy"
    if cache.exists():
        tokens = torch.from_numpy(np.load(cache).astype(np.int64))
    else:
        if tokenizer_file is None:
            tokens = tokenize_text(text, vocab_size)
        else:
            tokens = encode_lines(run_tokenizer(data, vocab_size, tokenizer_file), text)
        dtype = np.uint16 if vocab_size <= 65536 else np.int32
        tmp = cache.with_name(cache.name + ".tmp.npy")
        np.save(tmp, tokens.numpy().astype(dtype))
        atomic_write_bytes(cache, tmp.read_bytes())
        tmp.unlink()
    train, val = split_tokens(tokens, data.val_fraction)
    return TokenSplits(train=train, val=val, source=source, text_bytes=len(text.encode("utf-8")))


class BatchSampler:
    """Batches of (inputs, targets), each (B, T) int64, from one shard of non-overlapping windows."""

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, shard: int = 0, num_shards: int = 1
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        windows = (len(tokens) - 1) // seq_len
        self.windows = torch.arange(shard, windows, num_shards)
        if len(self.windows) == 0:
            raise ValueError(f"too few tokens ({len(tokens)}) for shard {shard} of {num_shards}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.shard = seed, shard
        self._epoch, self._order = -1, self.windows

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "data", self.shard, epoch))
            self._order = self.windows[torch.randperm(len(self.windows), generator=generator)]
            self._epoch = epoch
        return self._order

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.windows)
        starts = []
        for j in range(self.batch_size):
            position = step * self.batch_size + j
            starts.append(int(self._order_for(position // n)[position % n]) * self.seq_len)
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def validation_batches(val: torch.Tensor, seq_len: int, batch_size: int, count: int):
    """`count` batches of validation windows spread evenly over the held-out split (the same for every
    peer), so a small evaluation still samples every part of the corpus."""
    windows = (len(val) - 1) // seq_len
    wanted = min(count * batch_size, windows - windows % batch_size)
    starts = torch.linspace(0, windows - 1, wanted).long() * seq_len if wanted > 0 else torch.empty(0).long()
    for b in range(wanted // batch_size):
        rows = torch.stack([val[s : s + seq_len + 1] for s in starts[b * batch_size : (b + 1) * batch_size].tolist()])
        yield rows[:, :-1], rows[:, 1:]
