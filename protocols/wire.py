"""The wire form of the control plane's messages: the base classes, the registry, the one generic
``Batch`` envelope, msgpack encoding and the checks every frame passes (the messages themselves:
``protocols.messages``, which re-exports all of this).

Every message on a ZeroMQ socket is a registered dataclass, encoded as a msgpack map
``{"v": PROTOCOL_VERSION, "t": <type name>, "b": {<fields>}}``. Decoding checks, in order: the
frame size, that the bytes are msgpack, the envelope keys, the protocol version, that the type
is registered (and, when the receiver says what it expects, that it is one of those), that no
field is missing or unknown, every field's type, and the message's own consistency check
(``validate``: e.g. parallel per-sample lists of equal length). Anything else raises ``ProtocolError`` with
a message that names what was wrong; receivers log it and keep serving.

Several messages of one type travel as one ``Batch`` (the groups an engine step finished, the groups
admitted together): the same fields under the same names, one column each, every item checked as if it
had come alone. No message type has a plural twin.

Side formats (``protocols.side``: the tensor header, the transport notes, the weight fetch, the
reward pool's pipe) are ``SideMessage`` classes: the same typed fields and the same checks, in the
flat layout those formats have always had on the wire. ``decode`` is the one place where msgpack
bytes become a message, for both kinds.

Never pickle: msgpack carries only plain data, so a peer cannot make us run code.
Bulk tensors do not travel in these messages (see ``protocols.tensors`` for tensor frames).
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass
from itertools import chain
from operator import countOf
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

# 2: one TrajectoryReady / RewardRequest / RewardResult per group; 3: several of one type in a Batch (the
# plural types generate_requests, trajectories_ready, reward_requests and reward_results are gone)
PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # control messages are small; tensors use tensor frames


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _msgpack():
    """msgpack, imported at the first encode or decode: the message classes import without it, so code that
    only builds or validates them (the tensor frames' headers in GPU code) runs where msgpack is not installed
    (the bare GPU box of ``scripts/gpu_check.sh``)."""
    import msgpack

    return msgpack


REGISTRY: dict[str, type["Message"]] = {}  # control messages, looked up by the envelope's "t"
SIDE_REGISTRY: dict[str, type["SideMessage"]] = {}  # side formats, always decoded against an explicit type


def message(cls: type) -> type:
    """Class decorator: make a dataclass and register it under its TYPE name."""
    return _register(cls, REGISTRY)


def side_message(cls: type) -> type:
    """Class decorator for a ``SideMessage``: a dataclass registered under its TYPE name."""
    if not issubclass(cls, SideMessage):
        raise TypeError(f"{cls.__name__} must subclass SideMessage")
    return _register(cls, SIDE_REGISTRY)


def _register(cls: type, registry: dict) -> type:
    cls = dataclass(cls)
    name = cls.TYPE
    if name in REGISTRY or name in SIDE_REGISTRY:
        raise RuntimeError(f"message type {name!r} registered twice")
    registry[name] = cls
    return cls


class Message:
    TYPE: ClassVar[str] = ""
    KEY: ClassVar[str] = ""  # the field that names one message of a Batch (unique there), e.g. its group
    # per-sample lists, one entry a sample: PARALLEL ones of equal length, not empty; OPTIONAL ones empty
    # or as long (checked by ``validate``, and by a Batch over its columns at once)
    PARALLEL: ClassVar[tuple[str, ...]] = ()
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_body(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self) -> Optional[str]:
        """What is wrong with this message beyond field types (checked on encode and decode), or None.
        A class that overrides it checks PARALLEL and OPTIONAL itself."""
        if not self.PARALLEL:
            return None
        n = len(getattr(self, self.PARALLEL[0]))
        for name in self.OPTIONAL:
            k = len(getattr(self, name))
            if k and k != n:
                return f"{name} has {k} entries for {n} samples (expected none or one each)"
        return same_lengths(self, *self.PARALLEL)


class SideMessage(Message):
    """A message of a side format, in that format's flat layout: ``{"v", "t", <fields>}`` (``INLINE``)
    or, for the reward pool's private pipe, the bare map of fields. A field whose default is None
    is left out while it is None (so ``{"score": 1.0}`` and ``{"error": "..."}`` are one type)."""

    INLINE: ClassVar[bool] = True
    MAX_BYTES: ClassVar[int] = MAX_MESSAGE_BYTES

    def to_body(self) -> dict:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not (f.default is None and getattr(self, f.name) is None)
        }


# --------------------------------------------------------------------------------------------
# the generic batch envelope
# --------------------------------------------------------------------------------------------


@message
class Batch(Message):
    """Several control messages of one type in one frame: the groups one engine step finished (each a
    ``TrajectoryReady``), the groups admitted together (``GenerateRequest``), scored together
    (``RewardResult``), ... ``kind``: the items' TYPE (any registered control message but a batch).
    ``columns``: every field of that type, under its own name, -> the list of its values, one per item,
    in order (at least one item). Checked as if every item had come alone: each column as a list of its
    field's type, then each item's own ``validate``; an item is named by its ``KEY`` field (its group),
    which no two items share. Build one with ``Batch.of`` (or ``batched``), read it with ``items()``."""

    TYPE: ClassVar[str] = "batch"
    kind: str
    columns: dict

    @classmethod
    def of(cls, items: Sequence[Message]) -> "Batch":
        """``items`` (at least one, all of one control message type) as one batch; ValueError if not."""
        first = type(items[0]) if items else None
        if first is None or first is Batch or first.TYPE not in REGISTRY:
            raise ValueError(f"a batch carries one or more control messages, not {_short(list(items))}")
        other = next((m for m in items if type(m) is not first), None)
        if other is not None:
            raise ValueError(f"a batch carries one message type: {first.TYPE} and {type(other).TYPE} given")
        batch = cls(first.TYPE, {name: [getattr(m, name) for m in items] for name in _spec_names(first)})
        batch._items = list(items)
        return batch

    @property
    def item_type(self) -> type[Message]:
        return REGISTRY[self.kind]

    @property
    def size(self) -> int:
        """How many messages it carries."""
        return len(next(iter(self.columns.values())))

    def items(self) -> list[Message]:
        """The messages, each as it would have come alone (checked with the batch: no second validation)."""
        items = self.__dict__.get("_items")
        if items is None:
            cls = REGISTRY[self.kind]
            items = self._items = list(map(cls, *(self.columns[name] for name in _spec_names(cls))))
        return items

    def validate(self) -> Optional[str]:
        cls = REGISTRY.get(self.kind)
        if cls is None or cls is Batch:
            return f"kind {_short(self.kind)} is not a message type a batch carries"
        why = _columns_problem(self.kind, self.columns, _spec_names(cls))
        if why:
            return why
        for name, ok, tp in _column_spec(cls):
            if not ok(self.columns[name]):
                return _type_problem(self.columns[name], tp, f"{self.kind}.{name} (a column)")
        return self._repeated_key(cls) if _parallel_ok(cls, self.columns) else self._item_problem(cls)

    def _item_problem(self, cls: type[Message]) -> Optional[str]:
        """The first item that its own ``validate`` refuses, named, or the repeated key."""
        for i, item in enumerate(self.items()):
            why = item.validate()
            if why:
                named = f" ({cls.KEY} {getattr(item, cls.KEY)!r})" if cls.KEY else ""
                return f"{self.kind} #{i}{named}: {why}"
        return self._repeated_key(cls)

    def _repeated_key(self, cls: type[Message]) -> Optional[str]:
        keys = self.columns[cls.KEY] if cls.KEY else ()
        if len(set(keys)) != len(keys):
            again = next(k for i, k in enumerate(keys) if k in keys[:i])
            return f"{self.kind}.{cls.KEY} {again!r} repeats: one item each"
        return None


def batched(items: Sequence[Message]) -> Message:
    """One message for ``items`` (at least one, of one type): a lone item as itself, several in a ``Batch``."""
    return items[0] if len(items) == 1 else Batch.of(items)


def unbatch(msg: Message) -> list[Message]:
    """The messages ``msg`` carries: a batch's items, else ``msg`` alone."""
    return msg.items() if type(msg) is Batch else [msg]


def _columns_problem(kind: str, columns: dict, names: list[str]) -> Optional[str]:
    """What is wrong with a batch's columns beyond their types: missing, unknown, uneven or empty."""
    missing, unknown = [n for n in names if n not in columns], [k for k in columns if k not in names]
    if missing or unknown:
        return f"columns of {kind}: missing {missing}, unknown {unknown} (expected one a field)"
    if not all(isinstance(c, list) for c in columns.values()):
        bad = next(n for n, c in columns.items() if not isinstance(c, list))
        return f"{kind}.{bad} (a column): expected a list, got {type(columns[bad]).__name__}"
    lengths = [len(columns[n]) for n in names]
    if lengths.count(lengths[0]) != len(lengths):
        return "columns differ in length: " + ", ".join(f"{n}={k}" for n, k in zip(names, lengths))
    return None if lengths[0] else "no items"


def _parallel_ok(cls: type[Message], columns: dict) -> bool:
    """Every item's per-sample lists pass ``Message.validate``, proved over the columns in C (the common
    case: no item built); False also when ``cls`` has a ``validate`` of its own (its items decide)."""
    if cls.validate is not Message.validate:
        return False
    if not cls.PARALLEL:
        return True
    n = list(map(len, columns[cls.PARALLEL[0]]))
    if 0 in n or any(list(map(len, columns[name])) != n for name in cls.PARALLEL[1:]):
        return False
    for name in cls.OPTIONAL:
        k = list(map(len, columns[name]))
        if k != n and k.count(0) != len(k):
            return False
    return True


_COLUMN_SPECS: dict[type, list] = {}


def _column_spec(cls: type) -> list[tuple[str, Callable[[Any], bool], Any]]:
    """Per field of ``cls``: (name, check of a column of its values, the column's type), built once."""
    spec = _COLUMN_SPECS.get(cls)
    if spec is None:
        spec = _COLUMN_SPECS[cls] = [(name, _checker(list[tp]), list[tp]) for name, _, tp, _ in _spec(cls)]
    return spec


def _spec_names(cls: type) -> list[str]:
    return [name for name, *_ in _spec(cls)]


def same_lengths(msg: "Message", *names: str) -> Optional[str]:
    """The check of messages made of parallel per-sample lists: non-empty, equal lengths."""
    get = _GETTERS.get(names) or _GETTERS.setdefault(names, operator.attrgetter(*names))
    got = get(msg)
    lengths = list(map(len, got if len(names) > 1 else (got,)))  # one name: attrgetter gives the value itself
    if lengths.count(lengths[0]) != len(lengths):
        return "parallel lists differ in length: " + ", ".join(f"{n}={k}" for n, k in zip(names, lengths))
    if lengths[0] == 0:
        return f"{names[0]} is empty"
    return None


_GETTERS: dict[tuple[str, ...], operator.attrgetter] = {}  # names -> one C call returning those fields

# --------------------------------------------------------------------------------------------
# encoding and validation
# --------------------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    cls = type(msg)
    if REGISTRY.get(cls.TYPE, SIDE_REGISTRY.get(cls.TYPE)) is not cls:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a registered message type")
    for name, ok, tp, _ in _spec(cls):
        value = getattr(msg, name)
        if not ok(value):
            _type_error(value, tp, f"{msg.TYPE}.{name}")
    _check_consistent(msg)
    if not isinstance(msg, SideMessage):
        return _msgpack().packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, "b": msg.to_body()}, use_bin_type=True)
    body = msg.to_body()
    return _msgpack().packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, **body} if msg.INLINE else body, use_bin_type=True)


def decode(data: bytes | memoryview, expect: Optional[tuple[type, ...]] = None) -> Message:
    """Bytes -> message, or ProtocolError naming the problem. The one msgpack decode of the project.

    ``expect``: the message classes acceptable here. Control messages may leave it None (any
    registered type); side formats must name theirs (all side classes, never mixed with control).
    ``Batch`` in ``expect``: batches of the other types named there are acceptable too."""
    side = expect is not None and _is_side(expect)
    limit = max(c.MAX_BYTES for c in expect) if side else MAX_MESSAGE_BYTES
    if len(data) > limit:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {limit}-byte limit")
    raw = _unpack(data)
    cls, body = _side_body(raw, expect) if side else _envelope_body(raw, expect)
    msg = _build(cls, body)
    if cls is Batch and expect is not None and msg.item_type not in expect:
        raise ProtocolError(f"unexpected batch of {msg.kind!r} here (expected {', '.join(c.TYPE for c in expect)})")
    return msg


def build(cls: type, body: Any) -> Message:
    """The message of type ``cls`` from a body already unpacked (a side format carried inside another
    frame, as a tensor header's ``meta``): the same field, type and consistency checks as ``decode``."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.TYPE}: body is {type(body).__name__} {_short(body)}, expected a map")
    return _build(cls, body)


def _is_side(expect: Optional[tuple[type, ...]]) -> bool:
    kinds = {issubclass(c, SideMessage) for c in expect or ()}
    if len(kinds) > 1:
        raise TypeError(f"expect mixes side formats and control messages: {[c.__name__ for c in expect]}")
    if True in kinds and len(expect) > 1 and not all(c.INLINE for c in expect):
        raise TypeError(f"a bare side format carries no type name: expect exactly one, got {expect}")
    return kinds == {True}


def _unpack(data: bytes | memoryview) -> Any:
    try:
        return _msgpack().unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__}: {e})") from None


def _envelope_body(env: Any, expect: Optional[tuple[type, ...]]) -> tuple[type, dict]:
    if not isinstance(env, dict) or len(env) != 3 or "v" not in env or "t" not in env or "b" not in env:
        got = sorted(env) if isinstance(env, dict) else type(env).__name__
        raise ProtocolError(f"frame is not a message envelope {{v, t, b}} (got {got})")
    _check_version(env["v"])
    if not isinstance(env["b"], dict):
        raise ProtocolError(f"message body of {env['t']!r} is {type(env['b']).__name__}, expected a map")
    name = env["t"]
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r} (known: {', '.join(sorted(REGISTRY))})")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message type {name!r} here (expected {', '.join(c.TYPE for c in expect)})")
    return cls, env["b"]


def _side_body(raw: Any, expect: tuple[type, ...]) -> tuple[type, dict]:
    names = " or ".join(c.TYPE for c in expect)
    if not isinstance(raw, dict):
        raise ProtocolError(f"{names} frame is {type(raw).__name__} {_short(raw)}, expected a map")
    if not expect[0].INLINE:
        return expect[0], raw
    _check_version(raw.get("v"))
    cls = next((c for c in expect if c.TYPE == raw.get("t")), None)
    if cls is None:
        raise ProtocolError(f"expected a {names} frame, got type {_short(raw.get('t'))}")
    return cls, {k: v for k, v in raw.items() if k not in ("v", "t")}


def _check_version(v: Any) -> None:
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r} is not supported (this side speaks {PROTOCOL_VERSION})")


def _build(cls: type, body: dict) -> Message:
    checks = _spec(cls)
    if len(body) > len(checks) or not _NAMES[cls].issuperset(body):
        raise ProtocolError(f"{cls.TYPE}: unknown field {sorted(set(body) - _NAMES[cls])[0]!r}")
    get = body.get
    for name, ok, tp, required in checks:
        value = get(name, _ABSENT)
        if value is _ABSENT:
            if required:
                raise ProtocolError(f"{cls.TYPE}: missing field {name!r}")
        elif not ok(value):
            _type_error(value, tp, f"{cls.TYPE}.{name}")
    msg = cls(**body)
    _check_consistent(msg)
    return msg


def _check_consistent(msg: Message) -> None:
    why = msg.validate()
    if why:
        raise ProtocolError(f"{msg.TYPE}: {why}")


_ABSENT = object()  # a field the body does not carry
_HINTS: dict[type, dict] = {}
_SPECS: dict[type, list] = {}
_NAMES: dict[type, frozenset] = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _spec(cls: type) -> list[tuple[str, Callable[[Any], bool], Any, bool]]:
    """Per field, in order: (name, type check, type, required). Built once per class: the checks
    are closures made from the type hints, so a frame pays no ``typing`` introspection."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints, fields = _hints(cls), dataclasses.fields(cls)
        spec = [
            (
                f.name,
                _checker(hints[f.name]),
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in fields
        ]
        _NAMES[cls] = frozenset(f.name for f in fields)
        _SPECS[cls] = spec
    return spec


def _type_error(value: Any, tp: Any, where: str) -> None:
    raise ProtocolError(_type_problem(value, tp, where))


def _type_problem(value: Any, tp: Any, where: str) -> str:
    return f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:  # msgpack may carry an integral float as int
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checker(tp: Any) -> Callable[[Any], bool]:
    """A predicate: does a decoded value match the type hint ``tp`` (Optional/Union, None, int
    and float but never bool, list[...] item by item, dict, a class)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        alts = [_checker(a) for a in typing.get_args(tp)]
        return lambda v: any(ok(v) for ok in alts)
    if tp is type(None):
        return lambda v: v is None
    if tp is float:
        return _is_float
    if tp is int:
        return _is_int
    if origin is list:
        (item,) = typing.get_args(tp)
        ok_item = _checker(item)
        if item is str:  # the per-sample lists: one C-level pass each
            return lambda v: isinstance(v, list) and _all_str(v)
        if item in (int, float):  # exactly int (float) items counted in C; else item by item (bools never)
            return lambda v: isinstance(v, list) and (countOf(map(type, v), item) == len(v) or all(map(ok_item, v)))
        flat = _FLAT.get(typing.get_args(item)[0]) if typing.get_origin(item) is list else None
        if flat is not None:  # per group, per sample: proved in C over all items at once, else item by item
            return lambda v: _lists_of(v, flat) or (isinstance(v, list) and all(ok_item(x) for x in v))
        return lambda v: isinstance(v, list) and all(ok_item(x) for x in v)
    if tp is dict or origin is dict:
        return lambda v: isinstance(v, dict)
    return lambda v: isinstance(v, tp)


def _lists_of(v: Any, flat: Callable[[list], bool]) -> bool:
    """``v`` is exactly a list of exact lists whose items, all together, pass ``flat``: a sufficient
    condition checked in C (a False here is decided again item by item)."""
    return type(v) is list and countOf(map(type, v), list) == len(v) and flat(list(chain.from_iterable(v)))


def _all_numbers(v: list) -> bool:
    """Every item is exactly a float or an int (never a bool): what ``_is_float`` accepts, counted in C."""
    types = list(map(type, v))
    return countOf(types, float) + countOf(types, int) == len(types)


def _all_str(v: list) -> bool:
    """Every item is a str: ``str.join`` checks that in one C pass (a control frame is <= 16 MiB)."""
    try:
        "".join(v)
    except TypeError:
        return False
    return True


_FLAT: dict[type, Callable[[list], bool]] = {  # the item type of list[list[T]] -> all items are T, in C
    str: lambda v: _all_str(v),
    int: lambda v: countOf(map(type, v), int) == len(v),
    float: _all_numbers,
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
