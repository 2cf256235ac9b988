"""Byte-level BPE tokenizer (HuggingFace `tokenizers`), trained once per corpus and cached."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shoal.model.corpus import atomic_write_bytes, cache_dir

END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_chunks(text), trainer=trainer)
    return tokenizer


def _chunks(text: str, size: int = 1 << 16):
    for start in range(0, len(text), size):
        yield text[start : start + size]


def corpus_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cached_tokenizer(text: str, vocab_size: int, directory: Path | None = None) -> Tokenizer:
    """Load the tokenizer for this exact corpus and vocabulary size, training it the first time."""
    directory = directory or cache_dir()
    path = directory / f"tokenizer-{corpus_digest(text)}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(text, vocab_size)
    atomic_write_bytes(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer
