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

Unknown fields are refused; fields without a default are required. A field may also declare value
bounds (``ge``/``le`` for numbers, ``choices``, ``pattern`` and ``min_len``; ``item=FieldOptions(...)``
bounds each element of a ``tuple[X, ...]``). A nested dataclass may validate invariants across its
fields in ``__post_init__`` by raising a ``ProtocolError`` (or ``ValueError``/``TypeError``, which
become ``MalformedMessage``).

The same schemas read shoal's own documents (run configs, DHT records, the state manifest):
``load_document`` reads a decoded TOML/JSON/msgpack map, where an int may stand for a float (TOML
writes ``lr = 1``). A refusal is a ``MalformedMessage`` whose ``field`` is the dotted path of the
offending value (``"train.steps"``, ``"links[2].peer_id"``) and whose ``reason`` is the rest.
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
    """Per-field bounds, carried in ``dataclasses.field(metadata=...)``."""

    max_len: int | None = None
    min_len: int | None = None
    allow_nonfinite: bool = False
    token: bool = False
    ge: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] | None = None
    pattern: str | None = None
    item: FieldOptions | None = None

    def __post_init__(self) -> None:
        for name in ("max_len", "min_len"):
            bound = getattr(self, name)
            if bound is not None and (type(bound) is not int or bound < 0):
                raise ValueError(f"{name} must be a non-negative int, not {bound!r}")

    def given(self) -> set[str]:
        """The options set away from their defaults."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def wire_field(
    *,
    max_len: int | None = None,
    min_len: int | None = None,
    allow_nonfinite: bool = False,
    token: bool = False,
    ge: float | None = None,
    le: float | None = None,
    choices: tuple[Any, ...] | None = None,
    pattern: str | None = None,
    item: FieldOptions | None = None,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with bounds.

    ``max_len``/``min_len`` bound a str (characters), bytes or tuple field (also through ``| None``);
    ``allow_nonfinite`` lets a float field carry NaN and infinities; ``token`` limits a str field to
    ASCII letters, digits and ``. _ : # @ -`` (ids and peer ids: what a receiver may log or pass on);
    ``ge``/``le`` bound an int or float; ``choices`` lists the values a str or int may take;
    ``pattern`` is a regular expression a str must match in full; ``item`` bounds the elements of a
    ``tuple[X, ...]``.
    """
    options = FieldOptions(max_len, min_len, allow_nonfinite, token, ge, le, choices, pattern, item)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_OPTIONS_KEY: options})


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _malformed(path: str, reason: str) -> MalformedMessage:
    return MalformedMessage(f"{path}: {reason}" if path else reason, field=path, reason=reason)


def _refuse(path: str, reason: str) -> NoReturn:
    raise _malformed(path, reason)


def _fail(path: str, expected: str, value: object) -> NoReturn:
    _refuse(path, f"expected {expected}, got {type(value).__name__}")


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
            _refuse(path, "integer outside the int64 range")
        return value

    dump = load


class _Float(Kind):
    def __init__(self, allow_nonfinite: bool, widen_ints: bool = False) -> None:
        self.allow_nonfinite = allow_nonfinite
        self.widen_ints = widen_ints  # documents (TOML) write 1 for 1.0; the wire may not

    def load(self, value: object, path: str) -> float:
        if self.widen_ints and type(value) is int:
            value = float(_INT.load(value, path))
        if type(value) is not float:
            _fail(path, "float", value)
        if not self.allow_nonfinite and not math.isfinite(value):
            _refuse(path, "float must be finite")
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
            _refuse(path, f"string of {len(value)} characters exceeds {self.max_len}")
        if self.token and not _TOKEN.fullmatch(value):
            _refuse(path, "an id may hold only ASCII letters, digits and . _ : # @ -")
        return value

    def dump(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            _fail(path, "str", value)
        value = self.load(str(value), path)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _malformed(path, "string is not valid UTF-8 (lone surrogate)") from None
        return value


class _Bytes(Kind):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def load(self, value: object, path: str) -> bytes:
        if type(value) is not bytes:
            _fail(path, "bytes", value)
        if len(value) > self.max_len:
            _refuse(path, f"{len(value)} bytes exceeds {self.max_len}")
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
            _refuse(path, f"{len(value)} elements exceeds {self.max_len}")
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
            _refuse(path, f"expected {len(self.items)} elements, got {len(value)}")
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


class _Limits(Kind):
    """Value bounds declared on a field, checked after its type: ``ge``/``le``, ``choices``, ``pattern``
    (in full) and ``min_len``."""

    def __init__(self, inner: Kind, options: FieldOptions) -> None:
        self.inner = inner
        self.ge, self.le, self.choices, self.min_len = options.ge, options.le, options.choices, options.min_len
        self.pattern = None if options.pattern is None else re.compile(options.pattern)

    def check(self, value: Any, path: str) -> Any:
        if self.ge is not None and value < self.ge:
            _refuse(path, f"must be at least {self.ge}, got {value}")
        if self.le is not None and value > self.le:
            _refuse(path, f"must be at most {self.le}, got {value}")
        if self.choices is not None and value not in self.choices:
            _refuse(path, f"must be one of {', '.join(map(str, self.choices))}, got {quote(value)}")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            _refuse(path, f"{quote(value)} does not match {self.pattern.pattern}")
        if self.min_len is not None and len(value) < self.min_len:
            _refuse(path, f"needs at least {self.min_len} elements, got {len(value)}")
        return value

    def load(self, value: object, path: str) -> Any:
        return self.check(self.inner.load(value, path), path)

    def dump(self, value: object, path: str) -> Any:
        return self.check(self.inner.dump(value, path), path)


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
                name = key if type(key) is str and len(key) <= 64 and _TOKEN.fullmatch(key) else quote(key)
                _refuse(join_path(path, name), f"unknown field (known: {', '.join(self.fields)})")
        for name in self.required:
            if name not in value:
                _refuse(join_path(path, name), f"missing field '{name}'")
        kwargs = {name: self.fields[name].load(item, join_path(path, name)) for name, item in value.items()}
        try:
            return self.cls(**kwargs)
        except ProtocolError:
            raise
        except (TypeError, ValueError) as error:
            raise _malformed(path, f"refused by {self.cls.__name__}: {error}") from None

    def dump(self, value: object, path: str) -> dict[str, Any]:
        if type(value) is not self.cls:
            _fail(path, self.cls.__name__, value)
        return {name: kind.dump(getattr(value, name), join_path(path, name)) for name, kind in self.fields.items()}


_INT = _Int()
_BOOL = _Bool()
_STRUCTS: dict[tuple[type, bool], StructKind] = {}

# the options each field type takes
_ALLOWED = {
    str: {"max_len", "min_len", "token", "pattern", "choices"},
    bytes: {"max_len", "min_len"},
    "sequence": {"max_len", "min_len", "item", "allow_nonfinite"},
    "fixed": {"allow_nonfinite"},
    bool: set(),
    int: {"ge", "le", "choices"},
    float: {"ge", "le", "allow_nonfinite"},
    "struct": set(),
}
_LIMITS = {"ge", "le", "choices", "pattern", "min_len"}


def struct_kind(cls: type, document: bool = False) -> StructKind:
    """The (cached) schema of a frozen dataclass; raises ``TypeError`` for a type the wire cannot carry.
    ``document``: the schema reads local documents, where an int may stand for a float."""
    kind = _STRUCTS.get((cls, document))
    if kind is not None:
        if not kind.ready:
            raise TypeError(f"{cls.__name__} contains itself; recursive wire types are not supported")
        return kind
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass: messages are values")
    kind = _STRUCTS[(cls, document)] = StructKind(cls)
    try:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        if len(fields) > MAX_FIELDS:
            raise TypeError(f"{cls.__name__} has more than {MAX_FIELDS} fields")
        for field in fields:
            if not field.init:
                raise TypeError(f"{cls.__name__}.{field.name}: init=False fields cannot be decoded")
            options = field.metadata.get(_OPTIONS_KEY, FieldOptions())
            kind.fields[field.name] = _compile(hints[field.name], options, f"{cls.__name__}.{field.name}", document)
        kind.required = tuple(
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    except BaseException:
        del _STRUCTS[(cls, document)]
        raise
    kind.ready = True
    return kind


def load_document(cls: type, data: object, path: str = "", *, exact: bool = False) -> Any:
    """A ``cls`` read from a decoded document (TOML, JSON or a msgpack map shoal stores), checked
    field by field; raises ``MalformedMessage`` naming the first field that is wrong. ``exact``: as
    strict as the wire (an int does not stand for a float), for documents other peers wrote."""
    return struct_kind(cls, document=not exact).load(data, path)


def _compile(tp: Any, options: FieldOptions, where: str, document: bool) -> Kind:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        others = [arg for arg in args if arg is not type(None)]
        if len(args) != 2 or len(others) != 1:
            raise TypeError(f"{where}: only 'X | None' unions can go on the wire, not {tp!r}")
        return _Optional(_compile(others[0], options, where, document))
    kind, shape = _compile_type(tp, origin, args, options, where, document)
    unexpected = options.given() - _ALLOWED[shape]
    if unexpected:
        raise TypeError(f"{where}: {', '.join(sorted(unexpected))} do not apply to {tp!r}")
    return _Limits(kind, options) if options.given() & _LIMITS else kind


def _compile_type(
    tp: Any, origin: Any, args: tuple, options: FieldOptions, where: str, document: bool
) -> tuple[Kind, Any]:
    max_len = options.max_len
    if tp is str:
        return _Str(MAX_STR_LEN if max_len is None else max_len, options.token), str
    if tp is bytes:
        return _Bytes(MAX_MESSAGE_BYTES if max_len is None else max_len), bytes
    # the field's bounds are its own; its elements take `item` (non-finite floats carry over)
    item_options = options.item or FieldOptions(allow_nonfinite=options.allow_nonfinite)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        bound = MAX_SEQUENCE_LEN if max_len is None else max_len
        if bound > MAX_SEQUENCE_LEN:
            raise TypeError(f"{where}: max_len {bound} exceeds MAX_SEQUENCE_LEN ({MAX_SEQUENCE_LEN})")
        return _Sequence(_compile(args[0], item_options, f"{where}[]", document), bound), "sequence"
    if tp is bool:
        return _BOOL, bool
    if tp is int:
        return _INT, int
    if tp is float:
        return _Float(options.allow_nonfinite, widen_ints=document), float
    if origin is tuple and Ellipsis not in args:
        items = tuple(_compile(arg, item_options, f"{where}[{i}]", document) for i, arg in enumerate(args))
        return _FixedTuple(items), "fixed"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return struct_kind(tp, document), "struct"
    raise TypeError(f"{where}: unsupported wire type {tp!r}")
