"""Policy tokenizers for verifiable tasks: a character-level one over a task's small alphabet, and a
checkpoint's own `tokenizer.json` for a policy imported from Hugging Face.

The end of a completion is an ordinary character, `$`, so a completion's text says by itself
whether it ended, and rewards stay pure functions of text. Token-level importance weights only mean
something between policies that share a tokenizer, so its id travels in every bundle.

Character tokenizer: id 0 is padding and never a real token (the policy gives it zero probability);
every other id is one character. Checkpoint tokenizer: every id is a real token, `$` must be one of
them, and rows are padded with it (the usual pad = EOS); lengths, not a padding id, mark where each
completion ends.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

PAD_ID = 0
EOS = "$"


class PolicyTokenizer(Protocol):
    tokenizer_id: str
    vocab_size: int
    eos_id: int
    pad_id: int  # what rows are filled with past their end
    first_id: int  # the lowest id a completion may hold
    masks_padding: bool  # True: pad_id is no token, and the policy never predicts it

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int] | tuple[int, ...]) -> str: ...


class CharTokenizer:
    pad_id = PAD_ID
    first_id = PAD_ID + 1
    masks_padding = True

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet) or EOS not in alphabet:
            raise ValueError(f"alphabet {alphabet!r} must hold distinct characters including {EOS!r}")
        self.alphabet = alphabet
        self._ids = {ch: i + 1 for i, ch in enumerate(alphabet)}
        self.eos_id = self._ids[EOS]
        self.tokenizer_id = "char-" + hashlib.sha256(alphabet.encode()).hexdigest()[:12]

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 1  # + padding

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as error:
            raise ValueError(f"character {error.args[0]!r} is not in the alphabet {self.alphabet!r}") from None

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if i != PAD_ID)


class CheckpointTokenizer:
    """A checkpoint's `tokenizer.json` for task text: `$` is always its own token (the completion's end,
    whatever the merges would make of it), everything between is encoded as the tokenizer does."""

    first_id = 0
    masks_padding = False

    def __init__(self, file: Path, vocab_size: int, digest: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(file))
        eos = self._tokenizer.encode(EOS, add_special_tokens=False).ids
        if len(eos) != 1:
            raise ValueError(f"{file}: {EOS!r} is not a single token ({eos}); a task's completions end with it")
        self.eos_id = self.pad_id = eos[0]
        self.vocab_size = vocab_size  # the model's (its embedding may be wider than the tokenizer)
        self.tokenizer_id = "hf-" + digest[:12]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for index, part in enumerate(text.split(EOS)):
            if index:
                ids.append(self.eos_id)
            if part:
                ids += self._tokenizer.encode(part, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def check_round_trip(self, texts: list[str]) -> None:
        """Refuse a tokenizer that cannot write the task's text back as it read it."""
        for text in texts:
            back = self.decode(self.encode(text))
            if back != text:
                raise ValueError(f"the checkpoint's tokenizer reads {text!r} back as {back!r}")
