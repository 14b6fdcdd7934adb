"""What every config section is made of: the error, the field helpers, the checks, the ``Section`` base.

A section is a dataclass deriving from ``Section``. Building it (directly, or through the loader)
runs ``__post_init__``: first every field's value is checked against its annotation (``int``,
``float``, ``bool``, ``str``, ``list``, ``Optional[...]``, ``CpuList`` or a nested section), then
the section's own ``check()`` rules. Errors name the field as ``name=value: expected ...``; the
loader prefixes the section path (``actor.`` + ``eps_clip=0: expected > 0``), so the message a
user sees names the dotted key they wrote.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from contextlib import contextmanager
from typing import Any, Iterator, Sequence


class ConfigError(ValueError):
    """A config key is unknown or its value is out of range; the message names both."""


@contextmanager
def keys_under(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from inside a section with the section's dotted path in front of its key."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(prefix + str(e)) from None


# ---- fields: every field carries its help text as metadata["help"] ---------------------------


def _f(default: Any, help: str) -> Any:
    """A field with a default (copied per instance when mutable) and its help text."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _sub(cls: type, help: str, unread_by: str = "") -> Any:
    """A nested section, built with its own defaults; ``unread_by`` as for ``_unread``, for all its fields."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "unread_by": unread_by})


def _unread(default: Any, help: str, by: str) -> Any:
    """A field that the config accepts and checks but no code reads yet; its help says which issue wires it."""
    return _f(default, help + unread_note(by))


def unread_note(by: str) -> str:
    return f" [not read yet: wired by {by}]"


class CpuList(str):
    """A Linux cpu list ('0', '1-3', '0,2'); YAML and overrides may also give one CPU as a number."""


# ---- checks ----------------------------------------------------------------------------------


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def one_of(sec: Any, name: str, choices: Sequence[str]) -> None:
    value = getattr(sec, name)
    require(value in choices, name, value, " | ".join(choices))


def at_least(sec: Any, name: str, lo: int, note: str = "") -> None:
    """value >= lo; integers are described as such ('an integer >= 1')."""
    value = getattr(sec, name)
    kind = "an integer " if isinstance(value, int) else ""
    require(value >= lo, name, value, f"{kind}>= {lo}{note}")


def above(sec: Any, name: str, lo: float = 0) -> None:
    value = getattr(sec, name)
    require(value > lo, name, value, f"> {lo}")


def within(sec: Any, name: str, interval: str) -> None:
    """value in an interval written as in maths: '(0, 1]', '[0, 1)', '[0, 1]'."""
    value = getattr(sec, name)
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    ok_lo = value >= lo if interval[0] == "[" else value > lo
    ok_hi = value <= hi if interval[-1] == "]" else value < hi
    require(ok_lo and ok_hi, name, value, f"a number in {interval}")


# ---- the section base ------------------------------------------------------------------------


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a section (its module uses ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def optional_of(tp: Any) -> Any:
    """X for ``Optional[X]`` or ``X | None``; None for any other annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)][0]
    return None


def _typed(name: str, value: Any, tp: Any) -> Any:
    """``value`` if it fits annotation ``tp`` (ints widen to float, a CPU number to a cpu list), else ConfigError."""
    if optional_of(tp) is not None:
        return None if value is None else _typed(name, value, optional_of(tp))
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if tp is bool:
        require(isinstance(value, bool), name, value, "true or false")
    elif tp is int:
        require(is_int, name, value, "an integer")
    elif tp is float:
        require(is_int or isinstance(value, float), name, value, "a number")
        return float(value)
    elif tp is CpuList:
        require(is_int or isinstance(value, str), name, value, "a cpu list such as '0', '1-3' or '0,2'")
        return str(value)  # stored as a plain str (YAML dumps it as one)
    elif tp is str:
        require(isinstance(value, str), name, value, "a string")
    elif tp is list or typing.get_origin(tp) is list:
        require(isinstance(value, list), name, value, "a list")
    elif dataclasses.is_dataclass(tp):
        require(isinstance(value, tp), name, value, f"a {tp.__name__}")
    return value


class Section:
    """Base of every config dataclass: validated when built, re-validated on demand after edits."""

    def __post_init__(self) -> None:
        for name, tp in field_types(type(self)).items():
            setattr(self, name, _typed(name, getattr(self, name), tp))
        self.check()

    def check(self) -> None:
        """The section's own rules (ranges, choices, rules between its fields); types are checked before."""

    def validate(self) -> Any:
        """Check this section and every nested one again (after fields were assigned); returns self."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Section):
                with keys_under(f.name + "."):
                    value.validate()
        self.__post_init__()
        return self
