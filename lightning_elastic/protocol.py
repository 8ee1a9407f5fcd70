"""Wire protocol between the driver (``launcher``) and the workers (``lightning_elastic``).

This is the only module both sides import. It is standard-library only (no torch, no
requests) so the driver can use it without loading the worker runtime.

Every request is an HTTP POST with a JSON body and the per-job secret in the
``Authorization: Bearer <secret>`` header. Bodies are decoded into the frozen dataclasses
below by ``decode``, which rejects unknown, missing or mistyped fields with a
``ProtocolError`` naming the field, so a malformed request gets a clear 400 instead of
reaching the driver's state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from enum import Enum
from typing import Any, TypeVar

# Environment variables the driver sets for every worker (besides torch's usual RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
ENV_DRIVER_URL = "LIGHTNING_ELASTIC_DRIVER_URL"
ENV_SECRET = "LIGHTNING_ELASTIC_SECRET"
ENV_WORKER_ID = "LIGHTNING_ELASTIC_WORKER_ID"
ENV_HOSTNAME = "LIGHTNING_ELASTIC_HOSTNAME"
ENV_HEARTBEAT_INTERVAL = "LIGHTNING_ELASTIC_HEARTBEAT_INTERVAL"
ENV_ELASTIC_TIMEOUT = "LIGHTNING_ELASTIC_TIMEOUT"
ENV_LOST_MEMBER_WAIT = "LIGHTNING_ELASTIC_LOST_MEMBER_WAIT"
ENV_PROCESS_GROUP_TIMEOUT = "LIGHTNING_ELASTIC_PROCESS_GROUP_TIMEOUT"

AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer"

PATH_RENDEZVOUS = "/v1/rendezvous"
PATH_HEARTBEAT = "/v1/heartbeat"
PATH_ROUND_LOST = "/v1/round-lost"
PATH_REPORT = "/v1/report"

RENDEZVOUS_POLL = 5.0  # longest the service holds a rendezvous request before "wait"


class ProtocolError(ValueError):
    """A message does not match the protocol; the text names the field and what was expected."""


class RendezvousStatus(str, Enum):
    ASSIGNED = "assigned"  # the worker is a member of a newly formed round
    WAIT = "wait"  # no round for this worker yet: ask again
    EXIT = "exit"  # the worker is not part of the job any more: leave gracefully


class Outcome(str, Enum):
    DONE = "done"  # the training function returned: the only report that means success
    REMOVED = "removed"  # left gracefully because its slot was removed from the job
    FAILED = "failed"  # raised an error that was not a lost peer


@dataclasses.dataclass(frozen=True)
class RendezvousRequest:
    worker_id: str
    after_round: int  # the last round this worker was a member of (0: none yet)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A worker's place in one rendezvous round."""

    round: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    store_host: str
    store_port: int
    generation: int  # host-change generation this round was formed at


@dataclasses.dataclass(frozen=True)
class RendezvousReply:
    status: RendezvousStatus
    assignment: Assignment | None = None


@dataclasses.dataclass(frozen=True)
class HeartbeatRequest:
    worker_id: str
    known_generation: int
    wait_seconds: float  # long poll: answer early when the generation moves past known


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
    generation: int  # monotonic counter of announced host changes
    last_broken_round: int  # highest round known to have lost a member (0: none)


@dataclasses.dataclass(frozen=True)
class RoundLostRequest:
    worker_id: str
    round: int
    wait_seconds: float


@dataclasses.dataclass(frozen=True)
class RoundLostReply:
    lost: bool  # True: a member of the round is gone, the error was a collective failure


@dataclasses.dataclass(frozen=True)
class Report:
    worker_id: str
    round: int
    outcome: Outcome
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Ack:
    ok: bool = True


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    error: str


T = TypeVar("T")


def to_json(message: Any) -> bytes:
    return json.dumps(dataclasses.asdict(message), default=_enum_value).encode()


def _enum_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"cannot encode {type(value).__name__}")


def decode(cls: type[T], body: bytes | str | dict) -> T:
    """Build ``cls`` from JSON, checking every field's presence and type."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise ProtocolError(f"{cls.__name__}: body is not valid JSON ({err})") from None
    return _build(cls, body, cls.__name__)


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(unknown)}")
    values = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is not dataclasses.MISSING:
                continue
            raise ProtocolError(f"{where}: missing field '{name}'")
        values[name] = _convert(hints[name], data[name], f"{where}.{name}")
    return cls(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in hint)
            raise ProtocolError(f"{where}: expected one of {allowed}, got {value!r}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float's range: as unusable as inf
            raise ProtocolError(f"{where}: expected a finite number, got an integer too large") from None
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        # json.loads accepts NaN and Infinity; NaN passes "< 0" (and every bound after
        # it, e.g. a wait would have no limit), so refuse both before that check.
        if hint is float and not math.isfinite(value):
            raise ProtocolError(f"{where}: expected a finite number, got {value}")
        if hint in (int, float) and value < 0:
            raise ProtocolError(f"{where}: expected a non-negative number, got {value}")
        return value
    raise ProtocolError(f"{where}: unsupported type {hint}")
