"""Encode and decode wire messages: msgpack of ``{"v": PROTOCOL_VERSION, "t": tag, "b": body}``.

``decode`` is the boundary where untrusted bytes become typed values. It checks, in this order and
each before the next step costs anything: the size, msgpack well-formedness under msgpack's own
limits (no extension types, no duplicate or non-string map keys), the protocol version, the type
tag, and then every field against the message's schema. Whatever goes wrong, it raises a
``ProtocolError`` subclass and nothing else, so a handler can answer any bad input with an
``ErrorReply`` and carry on.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgpack

from .errors import MalformedMessage, MessageTooLarge, UnexpectedMessage, UnsupportedVersion, quote
from .limits import MAX_FIELDS, MAX_MESSAGE_BYTES, MAX_SEQUENCE_LEN
from .registry import registration_for_class, registration_for_tag
from .version import PROTOCOL_VERSION, is_compatible

M = TypeVar("M")

_ENVELOPE_KEYS = frozenset({"v", "t", "b"})


def encode(msg: object, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Serialize a registered message, checking it against its schema first.

    Raises ``TypeError`` for an object that is not a registered message (a local bug),
    ``MalformedMessage`` for a field value a peer would refuse, ``MessageTooLarge`` over ``max_bytes``.
    """
    entry = registration_for_class(type(msg))
    body = entry.schema.dump(msg, entry.cls.__name__)
    data = msgpack.packb({"v": PROTOCOL_VERSION, "t": entry.tag, "b": body}, use_bin_type=True)
    if len(data) > max_bytes:
        raise MessageTooLarge(f"{entry.cls.__name__} encodes to {len(data)} bytes, over the limit of {max_bytes}")
    return data


@overload
def decode(data: bytes | bytearray | memoryview, expected: type[M], *, max_bytes: int = ...) -> M: ...


@overload
def decode(
    data: bytes | bytearray | memoryview, expected: tuple[type, ...] | None = None, *, max_bytes: int = ...
) -> Any: ...


def decode(
    data: bytes | bytearray | memoryview,
    expected: type | tuple[type, ...] | None = None,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Any:
    """Parse and validate one message from a peer.

    ``expected`` (one registered class or a tuple of them) refuses any other message type with
    ``UnexpectedMessage`` before its body is validated. Raises only ``ProtocolError`` subclasses for
    bad input; passing an ``expected`` class that is not a registered message is a ``TypeError``.
    """
    allowed = _expected_classes(expected)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessage(f"a message must be bytes, not {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:  # before msgpack sees a single byte
        raise MessageTooLarge(f"message of {size} bytes exceeds the limit of {max_bytes}")
    envelope = _unpack(data, max_bytes)
    if type(envelope) is not dict:
        raise MalformedMessage(f"a message must be a msgpack map, not {type(envelope).__name__}")
    if "v" not in envelope:
        raise MalformedMessage("message has no protocol version 'v'")
    version = envelope["v"]
    if type(version) is not int:
        raise MalformedMessage(f"protocol version must be an int, not {type(version).__name__}")
    if not is_compatible(version):
        raise UnsupportedVersion(f"peer speaks protocol version {version}; this node speaks {PROTOCOL_VERSION}")
    if envelope.keys() != _ENVELOPE_KEYS:
        keys = ", ".join(sorted(quote(key) for key in envelope)[:4])
        raise MalformedMessage(f"envelope must hold exactly the keys 'v', 't', 'b', not {keys}")
    tag = envelope["t"]
    if type(tag) is not str:
        raise MalformedMessage(f"message type tag must be a str, not {type(tag).__name__}")
    entry = registration_for_tag(tag)
    if allowed is not None and entry.cls not in allowed:
        names = " or ".join(cls.__name__ for cls in allowed)
        raise UnexpectedMessage(f"expected {names}, got {entry.cls.__name__}")
    return entry.schema.load(envelope["b"], entry.cls.__name__)


def _expected_classes(expected: type | tuple[type, ...] | None) -> tuple[type, ...] | None:
    if expected is None:
        return None
    classes = expected if isinstance(expected, tuple) else (expected,)
    for cls in classes:
        registration_for_class(cls)  # TypeError for a local mistake, before any peer input is read
    return classes


class _DuplicateKey(ValueError):
    pass


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # msgpack would let the last duplicate win; two parsers could then disagree on what a message says.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _DuplicateKey
    return result


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack extension types are not part of the protocol")


def _unpack(data: bytes | bytearray | memoryview, max_bytes: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_unique_map,
            ext_hook=_refuse_ext,
            max_ext_len=0,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=MAX_SEQUENCE_LEN,
            max_map_len=MAX_FIELDS,
        )
    except _DuplicateKey:
        raise MalformedMessage("not valid: a msgpack map repeats a key") from None
    except Exception:  # untrusted bytes into a C parser: any failure at all means "malformed"
        raise MalformedMessage("not a valid protocol msgpack document") from None
