"""Typed protocol errors, each with a stable ``error_code`` and a one-line message safe to send to a peer.

"Safe" means: one line, bounded length, and peer-supplied text only ever quoted through ``quote()``
(escaped and truncated), so an error never echoes megabytes or control characters back.
"""

from __future__ import annotations

from typing import ClassVar

from .limits import MAX_ERROR_CHARS


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Collapse whitespace to single spaces and cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote(value: object, limit: int = 40) -> str:
    """An ASCII-escaped, truncated rendering of a value a peer sent us, for error messages."""
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProtocolError(Exception):
    """Something that arrived over the wire (or is about to be sent) breaks the protocol."""

    error_code: ClassVar[str] = "protocol_error"

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))

    @property
    def message(self) -> str:
        return self.args[0]


class MalformedMessage(ProtocolError):
    """Not msgpack, not an envelope, or a body that does not match the message's schema. A schema's
    refusal names the offending value's path in `field` (``"links[2].peer_id"``; ``""`` for the
    whole value) and says what is wrong with it in `reason`."""

    error_code = "malformed_message"

    def __init__(self, message: str, field: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.reason = one_line(reason or message)


class MessageTooLarge(ProtocolError):
    """Over a size limit; refused before any parsing."""

    error_code = "message_too_large"


class UnsupportedVersion(ProtocolError):
    """The peer speaks a protocol major version we do not."""

    error_code = "unsupported_version"


class UnknownMessageType(ProtocolError):
    """A type tag that no message is registered under."""

    error_code = "unknown_message_type"


class UnexpectedMessage(ProtocolError):
    """A valid message, but not one of the types the receiver was waiting for."""

    error_code = "unexpected_message"


class BadTensor(ProtocolError):
    """A tensor frame with the wrong dtype, shape or size, bad chunking, or non-finite values."""

    error_code = "bad_tensor"


_BY_CODE: dict[str, type[ProtocolError]] = {
    cls.error_code: cls
    for cls in (
        ProtocolError,
        MalformedMessage,
        MessageTooLarge,
        UnsupportedVersion,
        UnknownMessageType,
        UnexpectedMessage,
        BadTensor,
    )
}


def error_for_code(code: str, message: str) -> ProtocolError:
    """Rebuild the error a peer reported (an unknown code becomes a plain ``ProtocolError``)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else ProtocolError(f"{quote(code)}: {message}")
