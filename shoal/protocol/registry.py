"""The one registry of wire message types, keyed by a stable type tag.

Like hivemind's single table of msgpack extension codes: a tag, once released, names one message
forever. Registering a message is one decorator::

    @message("fwd")
    class ForwardHeader:
        microbatch: int
        route: tuple[int, ...]
        tensor: TensorHeader

``@message`` turns a plain class into a frozen dataclass (an explicit ``@dataclass(frozen=True)``
underneath works too) and compiles its schema at import, so an unsupported field type fails at once
rather than on the first message a peer sends.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar, dataclass_transform

from .errors import UnknownMessageType, quote
from .schema import StructKind, struct_kind, wire_field

M = TypeVar("M")

# Short, printable, stable: lower-case ASCII, digits and "_.-", starting with a letter.
_TAG_PATTERN = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


@dataclasses.dataclass(frozen=True)
class Registration:
    """A registered message type: its tag, its class and its compiled schema."""

    tag: str
    cls: type
    schema: StructKind


_BY_TAG: dict[str, Registration] = {}
_BY_CLASS: dict[type, Registration] = {}


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, wire_field))
def message(tag: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: make ``cls`` a frozen dataclass and register it under ``tag``."""
    if not isinstance(tag, str) or not _TAG_PATTERN.fullmatch(tag):
        raise ValueError(f"message tag {tag!r} must match {_TAG_PATTERN.pattern}")

    def register(cls: type[M]) -> type[M]:
        if not dataclasses.is_dataclass(cls):
            cls = dataclasses.dataclass(frozen=True)(cls)
        if tag in _BY_TAG:
            raise ValueError(f"message tag {tag!r} is already taken by {_BY_TAG[tag].cls.__qualname__}")
        if cls in _BY_CLASS:
            raise ValueError(f"{cls.__qualname__} is already registered as {_BY_CLASS[cls].tag!r}")
        entry = Registration(tag=tag, cls=cls, schema=struct_kind(cls))
        _BY_TAG[tag] = _BY_CLASS[cls] = entry
        return cls

    return register


def registration_for_tag(tag: str) -> Registration:
    """The message registered under ``tag`` (a tag from a peer: refused with ``UnknownMessageType``)."""
    entry = _BY_TAG.get(tag)
    if entry is None:
        raise UnknownMessageType(f"unknown message type {quote(tag)}")
    return entry


def registration_for_class(cls: type) -> Registration:
    """The registration of a local class; ``TypeError`` if it is not a message (a bug, not a peer's fault)."""
    entry = _BY_CLASS.get(cls)
    if entry is None:
        raise TypeError(f"{getattr(cls, '__qualname__', cls)!r} is not a registered message type")
    return entry


def tag_of(cls: type) -> str:
    """The wire tag of a registered message class."""
    return registration_for_class(cls).tag


def registered_messages() -> Mapping[str, type[Any]]:
    """Every registered message class by tag (a read-only snapshot)."""
    return MappingProxyType({tag: entry.cls for tag, entry in _BY_TAG.items()})
