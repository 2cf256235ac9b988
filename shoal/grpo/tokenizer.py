"""Policy tokenizers for verifiable tasks: a character-level one over a task's small alphabet, and a
checkpoint's own `tokenizer.json` for a policy imported from Hugging Face.

The end of a completion is an ordinary character, `$`, so a completion's text says by itself
whether it ended, and rewards stay pure functions of text. Token-level importance weights only mean
something between policies that share a tokenizer, so its id travels in every bundle.

Character tokenizer: id 0 is padding and never a real token (the policy gives it zero probability);
every other id is one character. Checkpoint tokenizer: every id is a real token, `$` must be one of
them, and rows are padded with it (the usual pad = EOS); lengths, not a padding id, mark where each
completion ends. For a chat task (an instruct model's own turn-taking) the checkpoint tokenizer wraps
each prompt in the checkpoint's chat template as a user turn, and `$` in task text is the template's
end-of-turn token (`<|im_end|>` for ChatML): the model ends its reply as it was tuned to, and rewards
still read one text.
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

    def encode_prompt(self, text: str) -> list[int]:
        """A task's prompt as the policy reads it (a chat model: inside its chat template)."""
        ...

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

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if i != PAD_ID)


class ChatFormat:
    """A checkpoint's chat template and the token that ends a turn (its `eos_token`)."""

    def __init__(self, template: str, end_token: str, bos_token: str = ""):
        self.template, self.end_token, self.bos_token = template, end_token, bos_token

    @classmethod
    def of_checkpoint(cls, folder: Path) -> ChatFormat:
        """The folder's `chat_template.jinja` (or `tokenizer_config.json`'s `chat_template`) and eos token."""
        import json

        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        file = folder / "chat_template.jinja"
        template = file.read_text() if file.is_file() else config.get("chat_template")
        end = config.get("eos_token")
        end = end.get("content") if isinstance(end, dict) else end
        if not isinstance(template, str) or not isinstance(end, str) or not end:
            raise ValueError(f"{folder}: no chat template and end-of-turn token (a chat task needs an instruct model)")
        bos = config.get("bos_token")
        return cls(template, end, bos.get("content", "") if isinstance(bos, dict) else bos or "")

    def user_turn(self, text: str) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            [[{"role": "user", "content": text}]], chat_template=self.template, add_generation_prompt=True,
            bos_token=self.bos_token, eos_token=self.end_token,
        )  # fmt: skip
        return rendered[0]

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.template}\0{self.end_token}".encode()).hexdigest()[:8]


class CheckpointTokenizer:
    """A checkpoint's `tokenizer.json` for task text: `$` is always its own token (the completion's end,
    whatever the merges would make of it), everything between is encoded as the tokenizer does."""

    first_id = 0
    masks_padding = False

    def __init__(self, file: Path, vocab_size: int, digest: str, chat: ChatFormat | None = None):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(file))
        self.chat = chat
        end = EOS if chat is None else chat.end_token
        eos = self._tokenizer.encode(end, add_special_tokens=False).ids
        if len(eos) != 1:
            raise ValueError(f"{file}: {end!r} is not a single token ({eos}); a task's completions end with it")
        self.eos_id = self.pad_id = eos[0]
        self.vocab_size = vocab_size  # the model's (its embedding may be wider than the tokenizer)
        self.tokenizer_id = "hf-" + digest[:12] + ("" if chat is None else "-chat" + chat.digest)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for index, part in enumerate(text.split(EOS)):
            if index:
                ids.append(self.eos_id)
            if part:
                ids += self._tokenizer.encode(part, add_special_tokens=False).ids
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat is None:
            return self.encode(text)
        return self._tokenizer.encode(self.chat.user_turn(text), add_special_tokens=False).ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        if self.chat is None:
            return self._tokenizer.decode(list(ids), skip_special_tokens=False)
        parts, start = [], 0
        for at, token in enumerate([*ids, self.eos_id]):
            if token == self.eos_id:
                parts.append(self._tokenizer.decode(list(ids[start:at]), skip_special_tokens=False))
                start = at + 1
        return EOS.join(parts)

    def check_round_trip(self, texts: list[str]) -> None:
        """Refuse a tokenizer that cannot write the task's text back as it read it."""
        for text in texts:
            back = self.decode(self.encode(text))
            if back != text:
                raise ValueError(f"the checkpoint's tokenizer reads {text!r} back as {back!r}")
