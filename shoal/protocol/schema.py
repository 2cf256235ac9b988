"""Field schemas, compiled once from a message dataclass's type hints.

The decoder checks every value a peer sends against these schemas, and the encoder runs the same
checks, so we never send what a peer would refuse. Supported field types, and what "strict" means:

- ``bool``: only ``True``/``False`` (an int is not a bool, and a bool is not an int);
- ``int``: int64 range;
- ``float``: a msgpack float on the wire (an int is accepted locally and sent as a float); finite
  unless the field is declared with ``wire_field(allow_nonfinite=True)``;
- ``str`` / ``bytes``: bounded length (``MAX_STR_LEN`` characters / ``MAX_MESSAGE_BYTES`` bytes by
  default, ``wire_field(max_len=...)`` to choose);
- ``tuple[X, ...]`` (bounded, ``MAX_SEQUENCE_LEN`` by default) and fixed ``tuple[X, Y]``;
- ``X | None``;
- a nested frozen dataclass (registered as a message or not), sent as a map of its fields.

Unknown fields are refused; fields without a default are required. A nested dataclass may validate
its own invariants in ``__post_init__`` by raising a ``ProtocolError`` (or ``ValueError``/``TypeError``,
which become ``MalformedMessage``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, NoReturn

from .errors import MalformedMessage, ProtocolError, quote
from .limits import INT64_MAX, INT64_MIN, MAX_FIELDS, MAX_MESSAGE_BYTES, MAX_SEQUENCE_LEN, MAX_STR_LEN

_OPTIONS_KEY = "shoal.protocol"
_TOKEN = re.compile(r"[A-Za-z0-9._:#@-]*")


@dataclasses.dataclass(frozen=True)
class FieldOptions:
    """Per-field wire bounds, carried in ``dataclasses.field(metadata=...)``."""

    max_len: int | None = None
    allow_nonfinite: bool = False
    token: bool = False


def wire_field(
    *,
    max_len: int | None = None,
    allow_nonfinite: bool = False,
    token: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with wire bounds.

    ``max_len`` bounds a str (characters), bytes or tuple field (also through ``| None``);
    ``allow_nonfinite`` lets a float field carry NaN and infinities; ``token`` limits a str field to
    ASCII letters, digits and ``. _ : # @ -`` (ids and peer ids: what a receiver may log or pass on).
    """
    if max_len is not None and (type(max_len) is not int or max_len < 0):
        raise ValueError(f"max_len must be a non-negative int, not {max_len!r}")
    options = FieldOptions(max_len=max_len, allow_nonfinite=allow_nonfinite, token=token)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_OPTIONS_KEY: options})


def _fail(path: str, expected: str, value: object) -> NoReturn:
    raise MalformedMessage(f"{path}: expected {expected}, got {type(value).__name__}")


class Kind:
    """One field type. ``load`` checks a decoded msgpack value; ``dump`` checks a local value for sending."""

    def load(self, value: object, path: str) -> Any:
        raise NotImplementedError

    def dump(self, value: object, path: str) -> Any:
        raise NotImplementedError


class _Bool(Kind):
    def load(self, value: object, path: str) -> bool:
        if type(value) is not bool:
            _fail(path, "bool", value)
        return value

    dump = load


class _Int(Kind):
    def load(self, value: object, path: str) -> int:
        if type(value) is not int:  # excludes bool, which is an int subclass
            _fail(path, "int", value)
        if not INT64_MIN <= value <= INT64_MAX:
            raise MalformedMessage(f"{path}: integer outside the int64 range")
        return value

    dump = load


class _Float(Kind):
    def __init__(self, allow_nonfinite: bool) -> None:
        self.allow_nonfinite = allow_nonfinite

    def load(self, value: object, path: str) -> float:
        if type(value) is not float:
            _fail(path, "float", value)
        if not self.allow_nonfinite and not math.isfinite(value):
            raise MalformedMessage(f"{path}: float must be finite")
        return value

    def dump(self, value: object, path: str) -> float:
        # Locally, Python's numeric tower lets an int stand for a float; the wire always gets a float.
        if type(value) is int:
            value = float(_INT.load(value, path))
        elif isinstance(value, float):
            value = float(value)
        else:
            _fail(path, "float", value)
        return self.load(value, path)


class _Str(Kind):
    def __init__(self, max_len: int, token: bool = False) -> None:
        self.max_len = max_len
        self.token = token

    def load(self, value: object, path: str) -> str:
        if type(value) is not str:
            _fail(path, "str", value)
        if len(value) > self.max_len:
            raise MalformedMessage(f"{path}: string of {len(value)} characters exceeds {self.max_len}")
        if self.token and not _TOKEN.fullmatch(value):
            raise MalformedMessage(f"{path}: an id may hold only ASCII letters, digits and . _ : # @ -")
        return value

    def dump(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            _fail(path, "str", value)
        value = self.load(str(value), path)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise MalformedMessage(f"{path}: string is not valid UTF-8 (lone surrogate)") from None
        return value


class _Bytes(Kind):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def load(self, value: object, path: str) -> bytes:
        if type(value) is not bytes:
            _fail(path, "bytes", value)
        if len(value) > self.max_len:
            raise MalformedMessage(f"{path}: {len(value)} bytes exceeds {self.max_len}")
        return value

    def dump(self, value: object, path: str) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            _fail(path, "bytes", value)
        return self.load(bytes(value), path)


class _Sequence(Kind):
    """``tuple[X, ...]``: a msgpack array of bounded length."""

    def __init__(self, item: Kind, max_len: int) -> None:
        self.item = item
        self.max_len = max_len

    def _items(self, value: tuple | list, path: str, convert: typing.Callable[..., Any]) -> tuple:
        if len(value) > self.max_len:
            raise MalformedMessage(f"{path}: {len(value)} elements exceeds {self.max_len}")
        return tuple(convert(item, f"{path}[{i}]") for i, item in enumerate(value))

    def load(self, value: object, path: str) -> tuple:
        if type(value) is not list and type(value) is not tuple:
            _fail(path, "array", value)
        return self._items(value, path, self.item.load)

    def dump(self, value: object, path: str) -> tuple:
        if not isinstance(value, tuple):  # a list would make the frozen message unhashable
            _fail(path, "tuple", value)
        return self._items(value, path, self.item.dump)


class _FixedTuple(Kind):
    """``tuple[X, Y]``: a msgpack array of exactly that many elements."""

    def __init__(self, items: tuple[Kind, ...]) -> None:
        self.items = items

    def _items(self, value: tuple | list, path: str, load: bool) -> tuple:
        if len(value) != len(self.items):
            raise MalformedMessage(f"{path}: expected {len(self.items)} elements, got {len(value)}")
        return tuple(
            (kind.load if load else kind.dump)(item, f"{path}[{i}]")
            for i, (kind, item) in enumerate(zip(self.items, value, strict=True))
        )

    def load(self, value: object, path: str) -> tuple:
        if type(value) is not list and type(value) is not tuple:
            _fail(path, "array", value)
        return self._items(value, path, load=True)

    def dump(self, value: object, path: str) -> tuple:
        if not isinstance(value, tuple):
            _fail(path, "tuple", value)
        return self._items(value, path, load=False)


class _Optional(Kind):
    def __init__(self, inner: Kind) -> None:
        self.inner = inner

    def load(self, value: object, path: str) -> Any:
        return None if value is None else self.inner.load(value, path)

    def dump(self, value: object, path: str) -> Any:
        return None if value is None else self.inner.dump(value, path)


class StructKind(Kind):
    """A frozen dataclass, sent as a map from field name to value (in declaration order)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: dict[str, Kind] = {}
        self.required: tuple[str, ...] = ()
        self.ready = False

    def load(self, value: object, path: str) -> Any:
        if type(value) is not dict:
            _fail(path, "map", value)
        for key in value:
            if key not in self.fields:
                raise MalformedMessage(f"{path}: unknown field {quote(key)}")
        for name in self.required:
            if name not in value:
                raise MalformedMessage(f"{path}: missing field '{name}'")
        kwargs = {name: self.fields[name].load(item, f"{path}.{name}") for name, item in value.items()}
        try:
            return self.cls(**kwargs)
        except ProtocolError:
            raise
        except (TypeError, ValueError) as error:
            raise MalformedMessage(f"{path}: refused by {self.cls.__name__}: {error}") from None

    def dump(self, value: object, path: str) -> dict[str, Any]:
        if type(value) is not self.cls:
            _fail(path, self.cls.__name__, value)
        return {name: kind.dump(getattr(value, name), f"{path}.{name}") for name, kind in self.fields.items()}


_INT = _Int()
_BOOL = _Bool()
_STRUCTS: dict[type, StructKind] = {}


def struct_kind(cls: type) -> StructKind:
    """The (cached) schema of a frozen dataclass; raises ``TypeError`` for a type the wire cannot carry."""
    kind = _STRUCTS.get(cls)
    if kind is not None:
        if not kind.ready:
            raise TypeError(f"{cls.__name__} contains itself; recursive wire types are not supported")
        return kind
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass: messages are values")
    kind = _STRUCTS[cls] = StructKind(cls)
    try:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        if len(fields) > MAX_FIELDS:
            raise TypeError(f"{cls.__name__} has more than {MAX_FIELDS} fields")
        for field in fields:
            if not field.init:
                raise TypeError(f"{cls.__name__}.{field.name}: init=False fields cannot be decoded")
            options = field.metadata.get(_OPTIONS_KEY, FieldOptions())
            kind.fields[field.name] = _compile(hints[field.name], options, f"{cls.__name__}.{field.name}")
        kind.required = tuple(
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    except BaseException:
        del _STRUCTS[cls]
        raise
    kind.ready = True
    return kind


def _compile(tp: Any, options: FieldOptions, where: str) -> Kind:
    max_len = options.max_len
    if tp is str:
        return _Str(MAX_STR_LEN if max_len is None else max_len, options.token)
    if tp is bytes:
        return _Bytes(MAX_MESSAGE_BYTES if max_len is None else max_len)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        others = [arg for arg in args if arg is not type(None)]
        if len(args) != 2 or len(others) != 1:
            raise TypeError(f"{where}: only 'X | None' unions can go on the wire, not {tp!r}")
        return _Optional(_compile(others[0], options, where))
    item_options = FieldOptions(allow_nonfinite=options.allow_nonfinite)  # max_len bounds the field only
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        bound = MAX_SEQUENCE_LEN if max_len is None else max_len
        if bound > MAX_SEQUENCE_LEN:
            raise TypeError(f"{where}: max_len {bound} exceeds MAX_SEQUENCE_LEN ({MAX_SEQUENCE_LEN})")
        return _Sequence(_compile(args[0], item_options, f"{where}[]"), bound)
    if max_len is not None:
        raise TypeError(f"{where}: max_len applies to str, bytes and tuple[X, ...] fields only")
    if options.token:
        raise TypeError(f"{where}: token applies to str fields only")
    if tp is bool:
        return _BOOL
    if tp is int:
        return _INT
    if tp is float:
        return _Float(options.allow_nonfinite)
    if origin is tuple and Ellipsis not in args:
        return _FixedTuple(tuple(_compile(arg, item_options, f"{where}[{i}]") for i, arg in enumerate(args)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return struct_kind(tp)
    raise TypeError(f"{where}: unsupported wire type {tp!r}")
