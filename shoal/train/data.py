"""Token data: the corpus through the tokenizer, a held-out split, and seeded per-shard sampling.

The token stream is cut into blocks; every k-th block is held out for validation, so the
validation text is drawn from the whole corpus rather than from whichever book happens to be
last. Training windows are split round-robin into disjoint shards, one per data node, and each
shard is visited in a seeded random order, epoch by epoch: the same (seed, shard, step) always
gives the same batch, on any machine.

A dataset of any size is tokenized as a stream (shoal.model.documents reads it a piece at a time)
straight into two files in the cache, train and validation, which are then memory-mapped: no
step holds the text or its tokens whole, so memory stays flat as the dataset grows.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from shoal.config import DataConfig, RunConfig
from shoal.files import atomic_write
from shoal.model.corpus import cache_dir, default_corpus_path
from shoal.model.documents import DataError, Dataset, open_dataset
from shoal.model.llama import derive_seed
from shoal.model.tokenizer import cached_tokenizer, corpus_digest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

HOLDOUT_BLOCK_TOKENS = 4096
ENCODE_BATCH_CHARS = 1 << 20
MIN_TEXT_CHARS = 1000
SPLITS_FORMAT = 1  # bump when the files' layout or the tokenization changes


@dataclass(frozen=True)
class TokenSplits:
    train: torch.Tensor  # (N_train,) token ids, uint16 or int32, memory-mapped from the cache
    val: torch.Tensor  # (N_val,)
    source: str
    text_bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.text_bytes / max(1, len(self.train) + len(self.val))


def holdout_period(val_fraction: float) -> int:
    return max(2, round(1 / val_fraction))


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    period = holdout_period(val_fraction)
    blocks = torch.arange(len(tokens)) // HOLDOUT_BLOCK_TOKENS
    is_val = blocks % period == period - 1
    if not bool(is_val.any()):  # a short text: hold out its tail instead
        is_val = torch.arange(len(tokens)) >= len(tokens) - _tail_length(len(tokens), val_fraction)
    return tokens[~is_val].contiguous(), tokens[is_val].contiguous()


def _tail_length(count: int, val_fraction: float) -> int:
    return max(1, int(count * val_fraction))


def text_lines(pieces: Iterable[str]) -> Iterator[str]:
    """The lines, endings kept, that `str.splitlines(keepends=True)` cuts from the pieces' whole
    text: the last line of each piece waits for the next, so a line (or a \r\n) cut across two
    pieces is still one line."""
    carry = ""
    for piece in pieces:
        lines = (carry + piece).splitlines(keepends=True)
        carry = lines.pop() if lines else ""
        yield from lines
    if carry:
        yield carry


def encoded_batches(tokenizer: Tokenizer, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """The text's token ids, about ENCODE_BATCH_CHARS of text at a time, line by line and with no
    special tokens (a checkpoint's tokenizer would otherwise start every line with its BOS)."""
    batch: list[str] = []
    size = 0
    for line in chain(text_lines(pieces), [None]):
        if line is not None:
            batch.append(line)
            size += len(line)
        if batch and (line is None or size >= ENCODE_BATCH_CHARS):
            encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
            yield np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64)
            batch, size = [], 0


def encode_lines(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """The text's token ids (see `encoded_batches`)."""
    return torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *encoded_batches(tokenizer, [text])]))


def tokenize_text(text: str, vocab_size: int, tokenizer_dir: Path | None = None) -> torch.Tensor:
    return encode_lines(cached_tokenizer(text, vocab_size, tokenizer_dir), text)


def run_dataset(data: DataConfig) -> tuple[Dataset, str]:
    """The run's dataset on this machine and its digest, checked against the run's `data.digest`."""
    if data.path and not Path(data.path).expanduser().exists():
        raise DataError(
            f"the run's data.path {data.path!r} is not on this machine; give this node its copy with --data PATH"
        )
    dataset = open_dataset(data.path or default_corpus_path(), data.text_field)
    digest = dataset.digest()
    if data.digest and digest != data.digest:
        raise DataError(
            f"data path {str(dataset.path)!r} holds other data (sha256 {digest[:12]}…) "
            f"than the run's (data.digest {data.digest[:12]}…)"
        )
    return dataset, digest


def with_local_data(run: RunConfig, path: str | Path) -> RunConfig:
    """The run with this machine's copy of its data at `path` (`--data`): the digest filled in where
    the run names none, and data other than the run's refused where it does."""
    dataset = open_dataset(Path(path).expanduser(), run.data.text_field)
    digest = dataset.digest()
    if run.data.digest and digest != run.data.digest:
        raise DataError(
            f"--data {str(path)!r} holds other data (sha256 {digest[:12]}…) than run {run.name!r} trains "
            f"(data.digest {run.data.digest[:12]}…)"
        )
    return run.replace({"data.path": str(dataset.path), "data.digest": digest})


def dataset_key(digest: str, text_field: str) -> str:
    return hashlib.sha256(f"{digest}\0{text_field}".encode()).hexdigest()[:16]


def run_tokenizer(data: DataConfig, vocab_size: int, tokenizer_file: Path | None = None) -> Tokenizer:
    """The tokenizer a run's data is tokenized with: the checkpoint's `tokenizer.json` for a run
    imported from one, else a BPE trained once per dataset and cached."""
    if tokenizer_file is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_file))
    dataset, digest = run_dataset(data)
    return cached_tokenizer(dataset.texts, vocab_size, key=dataset_key(digest, data.text_field))


def load_token_splits(data: DataConfig, vocab_size: int, tokenizer_file: Path | None = None) -> TokenSplits:
    """Tokens of the configured dataset (default: the Debian texts), tokenized once into the cache
    and memory-mapped; `tokenizer_file`: the run's checkpoint's tokenizer (see `run_tokenizer`)."""
    dataset, digest = run_dataset(data)
    content = dataset_key(digest, data.text_field)
    if tokenizer_file is None:
        tokenizer_id = "bpe"
    else:
        tokenizer_id = "hf" + corpus_digest(Path(tokenizer_file).read_text(encoding="utf-8"))
    key = f"{SPLITS_FORMAT}|{content}|{tokenizer_id}|{vocab_size}|{data.val_fraction}"
    stem = cache_dir() / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    meta_path = stem.with_suffix(".json")
    if not meta_path.exists():
        if tokenizer_file is None:
            tokenizer = cached_tokenizer(dataset.texts, vocab_size, key=content)
        else:
            tokenizer = run_tokenizer(data, vocab_size, tokenizer_file)
        meta = _tokenize_to_files(dataset, tokenizer, vocab_size, data.val_fraction, stem)
        meta.update(digest=digest, text_field=data.text_field, tokenizer=tokenizer_id, vocab_size=vocab_size)
        atomic_write(meta_path, json.dumps(meta, indent=1))  # written last: the files are complete
    meta = json.loads(meta_path.read_text())
    train = _mapped(stem.with_suffix(".train.bin"), meta["dtype"], meta["train_tokens"])
    val = _mapped(stem.with_suffix(".val.bin"), meta["dtype"], meta["val_tokens"])
    return TokenSplits(train=train, val=val, source=str(dataset.path), text_bytes=meta["text_bytes"])


def _mapped(path: Path, dtype: str, count: int) -> torch.Tensor:
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(count,)))  # copy-on-write: never written


class _SplitWriter:
    """Token ids in stream order into the train and validation files: `split_tokens`, streamed."""

    def __init__(self, train: BinaryIO, val: BinaryIO, dtype: np.dtype, period: int):
        self.train, self.val, self.dtype, self.period = train, val, dtype, period
        self.position = self.train_tokens = self.val_tokens = 0

    def write(self, ids: np.ndarray) -> None:
        is_val = (self.position + np.arange(len(ids))) // HOLDOUT_BLOCK_TOKENS % self.period == self.period - 1
        ids = ids.astype(self.dtype)
        self.train.write(ids[~is_val].tobytes())
        self.val.write(ids[is_val].tobytes())
        self.val_tokens += int(is_val.sum())
        self.train_tokens += len(ids) - int(is_val.sum())
        self.position += len(ids)


def _tokenize_to_files(
    dataset: Dataset, tokenizer: Tokenizer, vocab_size: int, val_fraction: float, stem: Path
) -> dict:
    dtype = np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)
    paths = {split: stem.with_suffix(f".{split}.bin") for split in ("train", "val")}
    tmp = {split: path.with_name(f".{path.name}.{os.getpid()}.tmp") for split, path in paths.items()}
    counted = {"chars": 0, "bytes": 0}

    def counting(pieces: Iterable[str]) -> Iterator[str]:
        for piece in pieces:
            counted["chars"] += len(piece)
            counted["bytes"] += len(piece.encode("utf-8"))
            yield piece

    try:
        with open(tmp["train"], "wb") as train, open(tmp["val"], "wb") as val:
            writer = _SplitWriter(train, val, dtype, holdout_period(val_fraction))
            for ids in encoded_batches(tokenizer, counting(dataset.texts())):
                if len(ids) and int(ids.max()) >= vocab_size:
                    raise DataError(f"the tokenizer gives id {int(ids.max())}, beyond model.vocab_size ({vocab_size})")
                writer.write(ids)
        if counted["chars"] < MIN_TEXT_CHARS:
            raise DataError(f"data path {str(dataset.path)!r} holds too little text ({counted['chars']} characters)")
        if writer.val_tokens == 0:  # a short text: hold out its tail instead
            tokens = np.fromfile(tmp["train"], dtype=dtype)
            tail = _tail_length(len(tokens), val_fraction)
            tokens[:-tail].tofile(tmp["train"])
            tokens[-tail:].tofile(tmp["val"])
            writer.train_tokens, writer.val_tokens = len(tokens) - tail, tail
        for split in ("train", "val"):
            os.replace(tmp[split], paths[split])
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return {
        "dtype": dtype.name,
        "train_tokens": writer.train_tokens,
        "val_tokens": writer.val_tokens,
        "text_bytes": counted["bytes"],
        "source": str(dataset.path),
        "form": dataset.form,
    }


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
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).long()  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def validation_batches(val: torch.Tensor, seq_len: int, batch_size: int, count: int):
    """`count` batches of validation windows spread evenly over the held-out split (the same for every
    peer), so a small evaluation still samples every part of the corpus."""
    windows = (len(val) - 1) // seq_len
    wanted = min(count * batch_size, windows - windows % batch_size)
    starts = torch.linspace(0, windows - 1, wanted).long() * seq_len if wanted > 0 else torch.empty(0).long()
    for b in range(wanted // batch_size):
        chosen = starts[b * batch_size : (b + 1) * batch_size].tolist()
        rows = torch.stack([val[s : s + seq_len + 1] for s in chosen]).long()
        yield rows[:, :-1], rows[:, 1:]
