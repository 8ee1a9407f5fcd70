"""``JobState`` to JSON and back, as it is: driven by its dataclass fields and their type hints.

What ``--state-dir`` saves is the live ``JobState`` (job/state.py), not a translation of it:
a field added to the state is saved with it, unless marked ``transient``; a type this codec
does not know is refused when the codec first meets it, naming the field.

- ``capture(state)``, under the driver's lock: a copy the decision loop cannot change
  afterwards. Its containers are its own; the values in them are shared, which holds
  because they are never changed in place (str, numbers, enums, tuples, frozen
  dataclasses: a worker's assignment, report and slot are replaced, never mutated).
- ``encode(copy, now)``, in the writer thread: the JSON text, transient fields left out,
  every ``clock`` field as seconds from ``now`` (the driver clock when captured).
- ``decode(value, now)``: a ``JobState`` again, clock fields as seconds from ``now``
  (0.0: from the save), transient fields their defaults. ``rebase`` moves the clock
  fields of a decoded state to a later ``now`` (the adopting driver's, once it adopts).

How values are written: dataclasses as objects of their fields; tuples, lists, sets and
deques as arrays; dicts with string keys as objects, other dicts as arrays of
``[key, value]``; enums by value; a ``BoundedHistory`` as ``{"items", "omitted"}``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any

from lightning_elastic.launcher.job.field_marks import is_clock, is_transient
from lightning_elastic.launcher.job.history import BoundedHistory
from lightning_elastic.launcher.job.state import JobState

# Container entries per ``json.dumps`` call (~1-2 ms each at 256 workers): the call holds the
# GIL for as long as it runs, and the writer thread shares it with the service answering the
# fleet (one call over 4,096 workers held it ~20 ms at a stretch).
_JSON_SLICE = 256
# Containers this deep in the state are written a slice at a time (the state's own fields,
# and theirs: the workers, the target, the round's members); deeper ones are small.
_SLICED_DEPTH = 2
_SEPARATORS = (",", ":")
# What the codec builds is a tree (dataclass fields, each container written once), so JSON's
# check for reference cycles, a third of its time, is left out.
_dumps_json = json.JSONEncoder(separators=_SEPARATORS, check_circular=False).encode

Encode = Callable[[Any, float], Any]  # (value, now) -> its JSON value
Decode = Callable[[Any], Any]  # JSON value -> value (clock fields from the save)
Copy = Callable[[Any], Any]  # value -> a copy the owner's later changes do not reach
Shift = Callable[[Any, float], Any]  # (value, seconds) -> the value, its clock times moved


@dataclasses.dataclass(frozen=True)
class _Codec:
    """How one type (in one clock context) is saved. A None step costs nothing: the value
    is JSON as it is (``encode``), is the value (``decode``), is immutable (``copy``) or
    holds no clock time (``shift``)."""

    encode: Encode | None = None
    decode: Decode | None = None
    copy: Copy | None = None
    shift: Shift | None = None


# ----- the API -----------------------------------------------------------------------------


def capture(state: JobState) -> JobState:
    """A copy of ``state``'s persisted facts (driver lock held: O(workers), ~1 µs each).
    Its transient fields are the live ones: nothing reads them from a copy."""
    copy = _codec_of(JobState).copy
    assert copy is not None
    return copy(state)


def encode(state: JobState, now: float) -> str:
    """``state`` (a ``capture``: the live state may not change meanwhile) as JSON, clock
    fields as seconds from ``now``."""
    encoder = _codec_of(JobState).encode
    assert encoder is not None
    return _dumps(encoder(state, now), 0)


def decode(value: str | dict[str, Any], now: float = 0.0) -> JobState:
    """The ``JobState`` that ``encode`` wrote (its text, or that text parsed), its clock
    fields as seconds from ``now``. Raises ValueError, TypeError or KeyError on anything
    else (a field it does not know, a value of the wrong shape)."""
    raw = json.loads(value) if isinstance(value, str) else value
    decoder = _codec_of(JobState).decode
    assert decoder is not None
    state = decoder(raw)
    if now:
        rebase(state, now)
    return state


def rebase(state: JobState, seconds: float) -> None:
    """Move every clock time of ``state`` ``seconds`` later (in place): a state decoded
    with its times from the save, put on the clock of the driver adopting it."""
    shift = _codec_of(JobState).shift
    if shift is not None:
        shift(state, seconds)


def persisted_fields(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s fields a save holds."""
    return tuple(f.name for f in dataclasses.fields(cls) if not is_transient(f))


# ----- JSON text, a slice at a time --------------------------------------------------------


def _dumps(value: Any, depth: int) -> str:
    if depth >= _SLICED_DEPTH or not isinstance(value, (dict, list)):
        return _dumps_json(value)
    if isinstance(value, dict):
        items = list(value.items())
        if len(items) > _JSON_SLICE:
            parts = [_dumps_json(dict(items[i:i + _JSON_SLICE]))[1:-1]
                     for i in range(0, len(items), _JSON_SLICE)]
        else:
            parts = [f"{_dumps_json(k)}:{_dumps(v, depth + 1)}" for k, v in items]
        return "{" + ",".join(parts) + "}"
    if len(value) > _JSON_SLICE:
        parts = [_dumps_json(value[i:i + _JSON_SLICE])[1:-1]
                 for i in range(0, len(value), _JSON_SLICE)]
    else:
        parts = [_dumps(v, depth + 1) for v in value]
    return "[" + ",".join(parts) + "]"


# ----- codecs by type, compiled once per type ----------------------------------------------


def _codec_of(cls: type) -> _Codec:
    return _codec(cls, False, None)


@functools.lru_cache(maxsize=None)
def _codec(tp: Any, clock: bool, maxlen: int | None) -> _Codec:
    """The codec of type hint ``tp``; ``clock``: its floats are driver-clock times;
    ``maxlen``: a deque's bound (from its field's default)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is float:
        if not clock:
            return _Codec()
        return _Codec(encode=lambda v, now: v - now, shift=lambda v, s: v + s)
    if tp in (int, str, bool, type(None)):
        return _Codec()
    if isinstance(tp, type) and issubclass(tp, Enum):
        # A str or int enum is written by JSON as its value already.
        plain = issubclass(tp, (str, int))
        return _Codec(encode=None if plain else (lambda v, now: v.value), decode=tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if len(arms) != 1 or len(args) != 2:
            raise TypeError(f"{tp!r}: only the union of one type with None is saved")
        return _optional(_codec(arms[0], clock, maxlen))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(tuple, _codec(args[0], clock, None), immutable=True)
        return _fixed_tuple([_codec(a, clock, None) for a in args])
    if origin in (list, set, frozenset):
        return _sequence(origin, _codec(args[0], clock, None), immutable=origin is frozenset)
    if origin is collections.deque:
        return _sequence(lambda items: collections.deque(items, maxlen=maxlen), _codec(args[0], clock, None),
                         immutable=False)
    if origin is dict:
        return _mapping(args[0] is str, _codec(args[0], clock, None), _codec(args[1], clock, None))
    if origin is BoundedHistory:
        return _history(_codec(args[0], clock, None))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, clock)
    raise TypeError(f"{tp!r} is not a type the state codec saves")


def _optional(inner: _Codec) -> _Codec:
    enc, dec, cp, sh = inner.encode, inner.decode, inner.copy, inner.shift
    return _Codec(
        encode=None if enc is None else (lambda v, now: None if v is None else enc(v, now)),
        decode=None if dec is None else (lambda v: None if v is None else dec(v)),
        copy=None if cp is None else (lambda v: None if v is None else cp(v)),
        shift=None if sh is None else (lambda v, s: None if v is None else sh(v, s)),
    )


def _sequence(make: Callable[[Any], Any], item: _Codec, immutable: bool) -> _Codec:
    """Tuples, lists, sets, frozensets, deques: JSON arrays. JSON writes tuples and lists
    as they are; sets and deques become lists."""
    enc, dec, cp, sh = item.encode, item.decode, item.copy, item.shift
    as_is = make in (tuple, list)
    return _Codec(
        encode=(None if as_is else lambda v, now: list(v)) if enc is None else
        (lambda v, now: [enc(x, now) for x in v]),
        decode=make if dec is None else (lambda v: make([dec(x) for x in v])),
        copy=(None if immutable else make) if cp is None else (lambda v: make([cp(x) for x in v])),
        shift=None if sh is None else (lambda v, s: make([sh(x, s) for x in v])),
    )


def _fixed_tuple(items: list[_Codec]) -> _Codec:
    """``tuple[X, Y, ...]``: a JSON array, position by position."""
    return _Codec(
        encode=None if all(c.encode is None for c in items) else
        (lambda v, now: [(c.encode(x, now) if c.encode else x) for c, x in zip(items, v)]),
        decode=lambda v: tuple((c.decode(x) if c.decode else x) for c, x in zip(items, v, strict=True)),
        copy=None if all(c.copy is None for c in items) else
        (lambda v: tuple((c.copy(x) if c.copy else x) for c, x in zip(items, v))),
        shift=None if all(c.shift is None for c in items) else
        (lambda v, s: tuple((c.shift(x, s) if c.shift else x) for c, x in zip(items, v))),
    )


def _mapping(str_keys: bool, key: _Codec, value: _Codec) -> _Codec:
    """Dicts: a JSON object when the keys are strings, else an array of [key, value]."""
    kenc, kdec, kcp, ksh = key.encode, key.decode, key.copy, key.shift
    venc, vdec, vcp, vsh = value.encode, value.decode, value.copy, value.shift
    if kcp is not None:
        raise TypeError("dict keys must be immutable")
    same = lambda x, *_: x  # noqa: E731
    kenc_, kdec_, ksh_ = kenc or same, kdec or same, ksh or same
    venc_, vdec_, vsh_ = venc or same, vdec or same, vsh or same
    if str_keys:
        encode = None if venc is None else (lambda v, now: {k: venc(x, now) for k, x in v.items()})
        decode = dict if vdec is None else (lambda v: {k: vdec(x) for k, x in v.items()})
    else:
        def encode(v: dict, now: float) -> list:
            return [[kenc_(k, now), venc_(x, now)] for k, x in v.items()]

        def decode(v: list) -> dict:
            return {kdec_(k): vdec_(x) for k, x in v}
    return _Codec(
        encode=encode,
        decode=decode,
        copy=dict if vcp is None else (lambda v: {k: vcp(x) for k, x in v.items()}),
        shift=None if ksh is None and vsh is None else (lambda v, s: {ksh_(k, s): vsh_(x, s) for k, x in v.items()}),
    )


def _history(item: _Codec) -> _Codec:
    """A ``BoundedHistory``: its kept entries and how many it omitted between them (it comes
    back with the default bounds, the only ones the job's state uses)."""
    enc, dec, cp, sh = item.encode, item.decode, item.copy, item.shift
    return _Codec(
        encode=lambda v, now: {"items": [enc(x, now) for x in v] if enc else list(v), "omitted": v.omitted},
        decode=lambda v: BoundedHistory.of([dec(x) for x in v["items"]] if dec else v["items"], v["omitted"]),
        copy=lambda v: BoundedHistory.of([cp(x) for x in v] if cp else list(v), v.omitted),
        shift=None if sh is None else (lambda v, s: BoundedHistory.of([sh(x, s) for x in v], v.omitted)),
    )


def _dataclass(cls: type, clock: bool) -> _Codec:
    """A dataclass: a JSON object of its persisted fields. ``clock``: every float in it is a
    driver-clock time (else only those of fields marked ``clock``)."""
    fields = _Fields(cls, clock)
    return _Codec(
        encode=fields.encode,
        decode=fields.decode,
        copy=None if fields.frozen and not fields.copied else fields.copy,
        shift=fields.shift if fields.shifted else None,
    )


_set_attribute = object.__setattr__  # past a frozen dataclass's own __setattr__, which refuses


class _Fields:
    """One dataclass's persisted fields, each with its codec, and the four steps over them.

    Instances are built and read through ``__dict__``, not ``__init__`` and ``getattr``: a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, and
    these steps run for every worker of the fleet."""

    def __init__(self, cls: type, clock: bool) -> None:
        self.cls = cls
        self.frozen: bool = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        hints = typing.get_type_hints(cls)
        every = dataclasses.fields(cls)
        codecs: dict[str, _Codec] = {}
        for f in every:
            if is_transient(f):
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise TypeError(f"{cls.__name__}.{f.name}: a transient field needs a default (a save leaves "
                                    "it out)")
                continue
            if not f.init:
                raise TypeError(f"cannot save {cls.__name__}.{f.name}: a field not given to __init__")
            hint, maxlen = hints[f.name], None
            if typing.get_origin(hint) is collections.deque and f.default_factory is not dataclasses.MISSING:
                maxlen = f.default_factory().maxlen  # a deque's bound is its default's
            try:
                codecs[f.name] = _codec(hint, clock or is_clock(f), maxlen)
            except TypeError as err:
                raise TypeError(f"cannot save {cls.__name__}.{f.name}: {err}; mark it transient "
                                "(field_marks.transient) or teach the state codec its type") from None
        self.names = frozenset(codecs)
        self.ordered = tuple(codecs)  # the persisted fields in their order (people read state.json too)
        self.left_out = tuple(f.name for f in every if f.name not in codecs)  # the transient ones
        self.encoded = tuple((n, c.encode) for n, c in codecs.items() if c.encode is not None)
        self.decoded = tuple((n, c.decode) for n, c in codecs.items() if c.decode is not None)
        self.copied = tuple((n, c.copy) for n, c in codecs.items() if c.copy is not None)
        self.shifted = tuple((n, c.shift) for n, c in codecs.items() if c.shift is not None)
        self.whole = len(codecs) == len(every)  # no field is transient
        # Immutable and saved whole: JSON can read its __dict__ as it is.
        self.as_is = self.frozen and self.whole and not self.encoded
        # Every field in its order, with its default (None for one without: never used, as
        # a field without a default is required in what is decoded).
        self.template = {f.name: None if f.default is dataclasses.MISSING else f.default for f in every}
        self.factories = tuple((f.name, f.default_factory) for f in every
                               if f.default_factory is not dataclasses.MISSING)
        self.required = frozenset(f.name for f in every if f.name in codecs and f.default is dataclasses.MISSING
                                  and f.default_factory is dataclasses.MISSING)
        self.post_init = getattr(cls, "__post_init__", None)

    def encode(self, v: Any, now: float) -> dict[str, Any]:
        d = v.__dict__
        if self.as_is:
            return d
        out = d.copy()  # (a copy in one go, then the transient fields out: a third of the time)
        for n in self.left_out:
            del out[n]
        if len(out) != len(self.ordered):  # an attribute that is no field: only the fields
            out = {n: d[n] for n in self.ordered}
        for n, enc in self.encoded:  # in place: the fields keep their order
            out[n] = enc(d[n], now)
        return out

    def decode(self, raw: dict[str, Any]) -> Any:
        if self.whole and raw.keys() == self.names:
            d = raw.copy()  # every field, in the order written (the fields' own)
        else:
            unknown, missing = raw.keys() - self.names, self.required - raw.keys()
            if unknown or missing:
                said = ([f"no field {', '.join(sorted(unknown))}"] if unknown else []) + \
                       ([f"{', '.join(sorted(missing))} missing"] if missing else [])
                raise ValueError(f"{self.cls.__name__}: {'; '.join(said)}")
            # Each field keeps its place when updated (a frozen dataclass's __dict__ may be
            # written as it is); a field missing (a transient one, or one added since the
            # save) takes its default.
            d = dict(self.template)
            for n, factory in self.factories:
                if n not in raw:
                    d[n] = factory()
            d.update(raw)
        for n, dec in self.decoded:
            if n in raw:
                d[n] = dec(d[n])
        new = object.__new__(self.cls)
        _set_attribute(new, "__dict__", d)
        if self.post_init is not None:
            self.post_init(new)
        return new

    def copy(self, v: Any) -> Any:
        """A new instance with the same attributes, its mutable fields copied in turn."""
        new = object.__new__(self.cls)
        _set_attribute(new, "__dict__", d := v.__dict__.copy())  # (twice as fast as updating the new one's)
        for n, cp in self.copied:
            d[n] = cp(d[n])
        return new

    def shift(self, v: Any, s: float) -> Any:
        """In place, but for a frozen dataclass: a new one."""
        if self.frozen:
            return dataclasses.replace(v, **{n: sh(getattr(v, n), s) for n, sh in self.shifted})
        for n, sh in self.shifted:
            setattr(v, n, sh(getattr(v, n), s))
        return v
