"""What the core asks the shell to do, as data.

The rules in ``job/`` change the ``JobState`` and say what else must happen by appending
effects to an ``Effects``; they never do it themselves. The shell (``launcher/driver``)
performs them in order once the step returns: wakes and notifications at once under the
job's lock, log lines and events through their background writers, signals to processes,
and process starts after the lock is released (a start may take seconds over ssh, and every
request of the service needs that lock).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any, Union

from lightning_elastic.launcher.job.slots import SlotAssignment
from lightning_elastic.launcher.job.verdict import Verdict


@dataclasses.dataclass(frozen=True)
class Wake:
    """These workers' pending requests must look again (their fate changed)."""

    worker_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class WakeLive:
    """Every live worker's pending requests must look again (a new generation, a broken round)."""


@dataclasses.dataclass(frozen=True)
class Changed:
    """Something the loop decides on happened: it must run a decision pass."""


@dataclasses.dataclass(frozen=True)
class Start:
    """Start a worker for this slot (its record is already in the state)."""

    worker_id: str
    slot: SlotAssignment
    number: int  # the worker's number (its id's suffix): names its log file


@dataclasses.dataclass(frozen=True)
class PrepareHost:
    """``--preload``: give this host its fork server before a worker needs it."""

    host: str


@dataclasses.dataclass(frozen=True)
class Signal:
    """Send ``signals`` to a worker's process group, in order."""

    worker_id: str
    signals: tuple[signal.Signals, ...]


@dataclasses.dataclass(frozen=True)
class Log:
    """A line of the driver's log (formatted lazily, as ``logging`` does)."""

    level: int
    message: str
    args: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Emit:
    """An event of the job's timeline (``events.jsonl``)."""

    kind: str
    fields: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Announced:
    """A host change was announced to the members of ``round`` (a timeline event that also
    marks where a recovery starts)."""

    round: int
    generation: int


@dataclasses.dataclass(frozen=True)
class RoundFormed:
    """Round ``number`` formed; ``forgotten``: finished workers dropped from the state, whose
    processes the shell keeps only to flush their output."""

    number: int
    members: tuple[dict[str, Any], ...]
    forgotten: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class End:
    """The job has ended with this verdict."""

    verdict: Verdict


Effect = Union[Wake, WakeLive, Changed, Start, PrepareHost, Signal, Log, Emit, Announced, RoundFormed, End]


class Effects:
    """The effects of one step, in order, with shorthands for the rules that append them."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Effect] = []

    def __iter__(self):  # noqa: ANN204 - an iterator of Effect
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def of(self, kind: type) -> list[Any]:
        """The effects of one kind (for tests and the shell's own bookkeeping)."""
        return [e for e in self.items if isinstance(e, kind)]

    def add(self, effect: Effect) -> None:
        self.items.append(effect)

    def wake(self, *worker_ids: str) -> None:
        self.items.append(Wake(worker_ids))

    def wake_live(self) -> None:
        self.items.append(WakeLive())

    def changed(self) -> None:
        self.items.append(Changed())

    def log(self, level: int, message: str, *args: Any) -> None:
        self.items.append(Log(level, message, args))

    def info(self, message: str, *args: Any) -> None:
        self.log(logging.INFO, message, *args)

    def warning(self, message: str, *args: Any) -> None:
        self.log(logging.WARNING, message, *args)

    def emit(self, kind: str, **fields: Any) -> None:
        self.items.append(Emit(kind, fields))

    def signal(self, worker_id: str, *signals: signal.Signals) -> None:
        self.items.append(Signal(worker_id, signals))

    def end(self, verdict: Verdict) -> None:
        self.items.append(End(verdict))
