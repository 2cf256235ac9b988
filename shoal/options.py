"""Command-line flags generated from config dataclasses: one default, one help text, one place.

A field declared with `option(...)` becomes a flag of every command that adds its dataclass
(`add_options`), and `from_args` builds the dataclass back from the parsed flags, so the dataclass's
`__post_init__` checks what came in. The flag's type follows the field's annotation: `int`, `float`,
`str` (each also `| None`), `bool` (a switch), `tuple[str, ...]` (a list of values); a field whose
flag has its own syntax (`K/N`, `STEP:SECONDS`) names a `parse` function that raises `ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_KEY = "shoal.option"


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # the flag's text to the field's value
    negate: bool = False  # a bool field that is True unless the flag (e.g. --no-relay) is given
    nargs: str = "*"  # for tuple fields: "+" when at least one value is needed

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def option(
    default: Any,
    help: str,
    *,
    flag: str,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    negate: bool = False,
    nargs: str = "*",
) -> Any:
    """A dataclass field that is also the command-line flag `flag`."""
    meta = {_KEY: Option(flag, help, metavar, parse, negate, nargs)}
    return dataclasses.field(default=default, metadata=meta)


def options_of(cls: type) -> list[tuple[dataclasses.Field, Option, Any]]:
    """(field, its option, its annotated type) for every field of `cls` that is a flag."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata[_KEY], hints[f.name]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _scalar(tp: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        others = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(others) == 1:
            return others[0]
    return tp


def add_options(parser: argparse.ArgumentParser | Any, cls: type, only: Iterable[str] | None = None) -> None:
    """Add the flags of `cls` (those of the fields named in `only`, if given) to `parser` or a group."""
    wanted = set(only) if only is not None else None
    for f, opt, tp in options_of(cls):
        if wanted is not None and f.name not in wanted:
            continue
        kwargs: dict[str, Any] = {"dest": opt.dest, "help": opt.help}
        scalar = _scalar(tp)
        if scalar is bool:
            parser.add_argument(opt.flag, action="store_true", **kwargs)
            continue
        kwargs["metavar"] = opt.metavar
        if opt.parse is not None:
            kwargs["default"] = None
        elif typing.get_origin(scalar) is tuple:
            kwargs.update(nargs=opt.nargs, default=list(f.default))
        else:
            kwargs.update(type=scalar, default=f.default)
        parser.add_argument(opt.flag, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """An instance of `cls` from the flags `add_options(parser, cls)` added (its checks run)."""
    values: dict[str, Any] = {}
    for f, opt, tp in options_of(cls):
        value = getattr(args, opt.dest)
        if _scalar(tp) is bool:
            value = not value if opt.negate else bool(value)
        elif opt.parse is not None:
            value = f.default if value is None else opt.parse(value)
        elif typing.get_origin(_scalar(tp)) is tuple:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def add_option_groups(parser: argparse.ArgumentParser, sections: Iterable[type]) -> None:
    """One help group per section, titled by the first line of its docstring."""
    for section in sections:
        title = (section.__doc__ or section.__name__).strip().splitlines()[0].rstrip(".")
        add_options(parser.add_argument_group(title), section)
