"""Byte-level BPE tokenizer (HuggingFace `tokenizers`), trained once per corpus and cached.

It is trained on the corpus's first TOKENIZER_SAMPLE_CHARS characters at most (SentencePiece bounds
its input the same way): the merges of a large corpus settle long before its end, and training
time and memory stay bounded however large the dataset is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shoal.model.corpus import atomic_write_bytes, cache_dir

END_OF_TEXT = "<|endoftext|>"
TRAINING_CHUNK_CHARS = 1 << 16
TOKENIZER_SAMPLE_CHARS = 64 << 20


def train_tokenizer(text: str | Iterable[str], vocab_size: int) -> Tokenizer:
    """A BPE over `text`, or over the first TOKENIZER_SAMPLE_CHARS of a stream of text pieces."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    pieces = [text] if isinstance(text, str) else text
    sample = islice(fixed_chunks(pieces), TOKENIZER_SAMPLE_CHARS // TRAINING_CHUNK_CHARS)
    tokenizer.train_from_iterator(sample, trainer=trainer)
    return tokenizer


def fixed_chunks(pieces: Iterable[str], size: int = TRAINING_CHUNK_CHARS) -> Iterator[str]:
    """The stream re-cut into `size`-character chunks, so a tokenizer trained on a text read in any
    pieces is the one trained on the whole text."""
    buffer = ""
    for piece in pieces:
        buffer += piece
        start = 0
        while len(buffer) - start >= size:
            yield buffer[start : start + size]
            start += size
        buffer = buffer[start:]
    if buffer:
        yield buffer


def corpus_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cached_tokenizer(
    text: str | Callable[[], Iterable[str]], vocab_size: int, directory: Path | None = None, key: str = ""
) -> Tokenizer:
    """Load the tokenizer for this exact corpus and vocabulary size, training it the first time.
    `text`: the corpus, or a function giving its pieces anew, with `key` naming its content."""
    directory = directory or cache_dir()
    key = key or corpus_digest(text if isinstance(text, str) else "".join(text()))
    path = directory / f"tokenizer-{key}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(text if isinstance(text, str) else text(), vocab_size)
    atomic_write_bytes(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer
