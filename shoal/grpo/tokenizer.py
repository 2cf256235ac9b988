"""A character-level tokenizer for verifiable tasks: one id per character of a small alphabet.

Id 0 is padding and is never a real token (the policy gives it zero probability); every other id
is one character. The end of a completion is an ordinary character, `$`, so a completion's text says
by itself whether it ended, and rewards stay pure functions of text. Token-level importance weights
only mean something between policies that share a tokenizer, so its id travels in every bundle.
"""

from __future__ import annotations

import hashlib

PAD_ID = 0
EOS = "$"


class CharTokenizer:
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
