"""``--state-dir``: what a restarted driver needs to adopt the running job, on disk.

The directory holds:

- ``lock``: ``flock``ed by the driver for its whole life, so that two drivers never both
  act on one job (the second says so and exits 2);
- ``secret`` (mode 0600): the job secret the workers sign with; a restarted driver must
  verify them with the same one;
- ``state.json``: the job's restartable state (``SavedState``), replaced atomically (temp
  file + rename) by a writer thread, never by the decision loop itself;
- ``alive``: touched every second by the running driver; its age on restart is the outage;
- ``driver-url``: ``http://HOST:PORT`` where the running driver serves, one line. A worker
  that cannot reach its driver re-reads it (``lightning_elastic/membership/driver_locator.py``): a
  driver restarted on another machine (the directory on a shared filesystem) is found so;
- ``workers/``: per worker, its output (``ID.log``, written by the worker itself, so a dead
  driver breaks nothing), how far the driver forwarded it (``ID.offset``) and its exit
  status (``ID.status``, written by its keeper, ``processes/keeper.py``).

One snapshot file rather than a replayed journal: the state a restart needs is small
(workers, the current round, the blacklist, counters) and a snapshot is read in one
``json.loads`` whatever the job's age, where a journal would need compaction to stay so.
``events.jsonl`` stays the timeline, for people.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.slots import SlotKey
from lightning_elastic.protocol import Assignment

log = logging.getLogger("lightning_elastic.driver")

STATE_VERSION = 1
ALIVE_EVERY = 1.0  # seconds between touches of ``alive``
_JSON_SLICE = 256  # workers per json.dumps call (~1-2 ms each)


@dataclasses.dataclass(frozen=True)
class WorkerEntry:
    """A live worker, as a restarted driver must find it again (or a finished member of the current round)."""

    worker_id: str
    host: str
    local_rank: int
    pid: int  # its keeper's pid (the process group the driver signals); 0: not adoptable
    start_ticks: int  # the keeper's start time (/proc/PID/stat field 22): a reused pid differs
    joined: bool
    member: bool  # a member of the current round (its assignment below is current)
    assignment: Assignment | None = None
    reported: str = ""  # the outcome it reported ("done", "removed", "failed"), if any
    reported_round: int = 0
    report_message: str = ""
    finished: str = ""  # a member of the current round that has ended: its WorkerState
    leave: bool = False
    log_file: str = ""  # its --log-dir file, appended to by the next driver
    standby: bool = False  # a hot spare (--spares): waits at the rendezvous, in no round


@dataclasses.dataclass(frozen=True)
class RoundEntry:
    number: int
    generation: int
    members: tuple[str, ...]  # worker ids in rank order


@dataclasses.dataclass(frozen=True)
class BlacklistEntry:
    host: str
    local_rank: int | None  # None: the whole host
    count: int
    remaining: float | None  # seconds of cooldown left when saved; None: for good


@dataclasses.dataclass(frozen=True)
class HoldEntry:
    """A slot left on a preemption notice, kept for its worker's return a while longer."""

    host: str
    local_rank: int
    remaining: float  # seconds of the hold left when saved


@dataclasses.dataclass(frozen=True)
class FirstExitEntry:
    """Training returned and this worker exited first: the others have --exit-timeout from then."""

    worker_id: str
    elapsed: float  # seconds since, when saved


@dataclasses.dataclass(frozen=True)
class TargetEntry:
    host: str
    local_rank: int
    rank: int
    size: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclasses.dataclass(frozen=True)
class SavedState:
    """The job's restartable state: plain data, saved and loaded whole (tests compare it)."""

    address: str
    port: int
    next_worker: int
    generation: int
    round: RoundEntry | None
    broken_rounds: tuple[int, ...]
    workers: tuple[WorkerEntry, ...]
    target: tuple[TargetEntry, ...]
    announced: bool  # a host change was announced for the current target
    rounds: tuple[int, ...]  # world sizes so far
    failures: tuple[str, ...]
    blacklisted: tuple[str, ...]
    blacklist: tuple[BlacklistEntry, ...]
    departures: tuple[str, ...]
    outages: tuple[str, ...]  # one line per earlier driver restart
    saved_at: float  # wall clock
    # What the driver was waiting out (absent from a state saved before they were kept).
    standby: tuple[SlotKey, ...] = ()  # the hot spares' slots (--spares)
    holds: tuple[HoldEntry, ...] = ()
    first_exit: FirstExitEntry | None = None
    # Round numbers and generations the driver may have announced before its next save
    # landed (saves are not waited for): a restarted driver that finds its workers ahead of
    # ``round`` numbers its next round and generation past these (0: the saved ones).
    reserved_round: int = 0
    reserved_generation: int = 0
    # Worker numbers the driver may have given to workers it started before its next save:
    # a restarted driver numbers its own past these, so that no id is given twice (0: none).
    reserved_worker: int = 0
    # What the bounded histories (rounds, failures, departures) left out between their first
    # and newest entries: the reset limit and the summary count them (0: a state saved before).
    rounds_omitted: int = 0
    failures_omitted: int = 0
    departures_omitted: int = 0

    def to_json(self) -> str:
        """By hand, not ``dataclasses.asdict`` (which deep-copies): 4,096 workers in ~0.05 s.

        The workers are encoded a slice at a time: ``json.dumps`` holds the GIL for as long
        as it runs, and the writer thread shares it with the service answering the fleet
        (one call over 4,096 workers held it ~20 ms at a stretch)."""
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "workers"}
        raw["round"] = _flat(self.round) if self.round else None
        for key in ("target", "blacklist", "standby", "holds"):
            raw[key] = [_flat(x) for x in raw[key]]
        raw["first_exit"] = _flat(self.first_exit) if self.first_exit else None
        head = json.dumps({"version": STATE_VERSION, **raw}, separators=(",", ":"))
        slices = []
        for start in range(0, len(self.workers), _JSON_SLICE):
            entries = [{**_flat(w), "assignment": _flat(w.assignment) if w.assignment else None}
                       for w in self.workers[start:start + _JSON_SLICE]]
            slices.append(json.dumps(entries, separators=(",", ":"))[1:-1])
        return f'{head[:-1]},"workers":[{",".join(slices)}]}}'

    @classmethod
    def from_json(cls, text: str) -> SavedState:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.pop("version", None) != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} job state")
        raw["round"] = RoundEntry(**{**raw["round"], "members": tuple(raw["round"]["members"])}) if raw["round"] else None
        raw["workers"] = tuple(
            WorkerEntry(**{**w, "assignment": Assignment(**w["assignment"]) if w["assignment"] else None})
            for w in raw["workers"])
        raw["target"] = tuple(TargetEntry(**t) for t in raw["target"])
        raw["blacklist"] = tuple(BlacklistEntry(**b) for b in raw["blacklist"])
        raw["standby"] = tuple(SlotKey(**e) for e in raw.get("standby", ()))
        raw["holds"] = tuple(HoldEntry(**e) for e in raw.get("holds", ()))
        raw["first_exit"] = FirstExitEntry(**raw["first_exit"]) if raw.get("first_exit") else None
        for key in ("broken_rounds", "rounds", "failures", "blacklisted", "departures", "outages"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


def safe_name(worker_id: str) -> str:
    """A worker id as a file name (ids stay unique: they end in their own number)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)


def _flat(item: Any) -> dict[str, Any]:
    """A flat dataclass's fields (shallow: its values are plain)."""
    return dict(item.__dict__)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that a reader (or a crash) sees the old or the new whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class StateDir:
    """The files of one ``--state-dir``; ``lock()`` first, ``release()`` at the very end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.workers = path / "workers"
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take the directory for this driver; ConfigError when another driver holds it."""
        try:
            self.workers.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"--state-dir: cannot use {self.path}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"--state-dir {self.path}: another driver (pid {holder}) runs this job; "
                              "it must exit before another can take over") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    @property
    def url_file(self) -> Path:
        """``driver-url``, as an absolute path: workers read it from their own directory."""
        return (self.path / "driver-url").absolute()

    def write_url(self, url: str) -> None:
        """Say where this driver serves (at its start, before any worker can need it)."""
        write_atomic(self.url_file, f"{url}\n".encode())

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the flock
            self._lock_fd = None

    def secret(self) -> str:
        """The job's secret: the one saved here, else a new one saved with mode 0600."""
        path = self.path / "secret"
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text().strip()
            if len(text) == 64:
                return text
        value = secrets.token_hex(32)
        write_atomic(path, value.encode(), 0o600)
        return value

    def load(self) -> SavedState | None:
        """The saved state of a job still running, or None (none saved, or unreadable: said)."""
        path = self.path / "state.json"
        try:
            return SavedState.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as err:
            log.warning("--state-dir: ignoring %s, which cannot be read (%s): starting a new job.", path, err)
            return None

    def save(self, state: SavedState) -> None:
        write_atomic(self.path / "state.json", state.to_json().encode())

    def touch_alive(self) -> None:
        path = self.path / "alive"
        try:
            os.utime(path)
        except FileNotFoundError:
            path.touch()

    def last_alive(self) -> float | None:
        try:
            return (self.path / "alive").stat().st_mtime
        except OSError:
            return None

    def worker_file(self, worker_id: str, suffix: str) -> Path:
        """``workers/<id>.<suffix>``, the id made a safe file name."""
        return self.workers / f"{safe_name(worker_id)}.{suffix}"

    def clear(self) -> None:
        """The job has ended: nothing is left to adopt (the secret goes too: a new job, a new one)."""
        for name in ("state.json", "alive", "secret", "driver-url"):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        # remote/: ssh workers' files, here when the hosts share this directory.
        for path in [*self.workers.glob("*"), *(self.path / "remote").glob("*")]:
            with contextlib.suppress(OSError):
                path.unlink()


class StateWriter:
    """Saves the newest submitted state from a thread of its own, and touches ``alive``.

    ``submit`` only hands the snapshot over: a slow disk delays the file, never the
    driver's decisions. Snapshots submitted while one is written are coalesced: the
    newest wins.
    """

    def __init__(self, state_dir: StateDir) -> None:
        self._dir = state_dir
        self._cond = threading.Condition()
        self._pending: SavedState | Callable[[], SavedState] | None = None
        self._closed = False
        self._failed = False
        self.last_write_s = 0.0  # how long the last save took here (state, JSON, write): paces the next
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)

    def start(self) -> None:
        self._dir.touch_alive()
        self._thread.start()

    def submit(self, state: SavedState | Callable[[], SavedState]) -> None:
        """Save ``state``, or what it returns (called here: ``adoption.Snapshot.state``)."""
        with self._cond:
            self._pending = state
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is pending, then stop (bounded)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    def _run(self) -> None:
        next_touch = time.monotonic() + ALIVE_EVERY
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    if not self._cond.wait(max(0.0, next_touch - time.monotonic())):
                        break
                state, self._pending = self._pending, None
                closed = self._closed
            try:
                if state is not None:
                    started = time.perf_counter()
                    self._dir.save(state() if callable(state) else state)
                    self.last_write_s = time.perf_counter() - started
                if time.monotonic() >= next_touch:
                    self._dir.touch_alive()
                    next_touch = time.monotonic() + ALIVE_EVERY
                self._failed = False
            except OSError as err:
                if not self._failed:  # said once, not every second
                    log.warning("--state-dir: cannot write %s (%s): a restarted driver may not adopt the job.",
                                self._dir.path, err.strerror or err)
                self._failed = True
            if closed:
                return
