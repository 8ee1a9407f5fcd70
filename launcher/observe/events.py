"""The job's membership timeline: ``events.jsonl`` in ``--log-dir``, one JSON object a line.

Every event has ``time`` (wall clock, seconds since the epoch: workers' first-step times
come from their own clocks, and the driver's monotonic clock means nothing to them) and
``kind``; the other fields depend on the kind:

=================== =============================================================
``job_started``     ``np``, ``min_np``, ``max_np``
``hosts_changed``   ``added``, ``removed`` (host names; the first discovery adds all)
``host_blacklisted``  ``host``, ``reason``
``slot_blacklisted``  ``host``, ``slot``, ``reason`` (one slot of a host that stays in use)
``worker_started``  ``worker``, ``host``, ``pid``
``worker_failed``   ``worker``, ``host``, ``reason``
``worker_left``     ``worker``, ``host``, ``reason`` (removed, preempted, stopped)
``worker_done``     ``worker``, ``host``
``reset_announced`` ``round``, ``generation`` (a host change: members re-form)
``round_broken``    ``round``, ``cause`` (a member was lost)
``round_formed``    ``round``, ``size``, ``members`` (``[{"rank", "worker", "host"}]``)
``first_step``      ``round``, ``at`` (the earliest first step a member reported)
``recovery``        ``round``, ``after`` (``"fault"`` or ``"host change"``), ``since``,
                    ``duration_s``: from the fault (the round breaking) or the
                    announcement to the new round's first step
``driver_restarted``  ``outage_s``, ``adopted``, ``ended``, ``round`` (``--state-dir``: a
                    new driver took the job over after that long without one)
``workers_adopted``  ``after_s``: from the new driver's start until every adopted
                    worker had reached it
``driver_handed_over``  ``reason`` (``--state-dir`` and SIGTERM: the driver exited, its
                    workers left running for the next driver; no ``job_ended``)
``job_ended``       ``success``, ``reason``
=================== =============================================================

``lightning-elastic timeline LOGDIR`` draws it (``launcher/observe/timeline.py``).

A ``--log-dir`` used again keeps both jobs: ``prepare_log_dir`` moves the previous job's
files (``events.jsonl``, the worker logs, a drawn timeline) into ``job-<its start>/`` in the
directory, where ``lightning-elastic timeline`` still reads them, before the new job writes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.observe.line_file import BackgroundLineFile
from lightning_elastic.launcher.job.state import ROUNDS_KEPT

FILE_NAME = "events.jsonl"
# What one job writes to its --log-dir (timeline.png is `lightning-elastic timeline`'s default).
JOB_FILES = (FILE_NAME, "worker-*.log", "timeline.png")


def prepare_log_dir(directory: Path) -> str | None:
    """Create ``directory``; if a previous job wrote there, move its files aside, into
    ``directory/job-<its start>/``, and return the line that says so (else None).

    Appending would interleave two jobs in one ``events.jsonl`` (and one timeline) and in
    worker logs of the same names; overwriting would lose the first job. Raises ConfigError
    when the directory cannot be made or the files cannot be moved.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--log-dir: cannot create {directory}: {err.strerror or err}") from None
    previous = sorted({path for pattern in JOB_FILES for path in directory.glob(pattern) if path.is_file()})
    if not previous:
        return None
    started = _job_start(directory / FILE_NAME, previous)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    target = directory / f"job-{stamp}"
    suffix = 1
    while target.exists():  # two jobs started in the same second
        suffix += 1
        target = directory / f"job-{stamp}-{suffix}"
    try:
        target.mkdir()
        for path in previous:
            os.replace(path, target / path.name)
    except OSError as err:
        raise ConfigError(f"--log-dir: cannot move the previous job's files to {target}: {err.strerror or err}") from None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return (f"--log-dir {directory} held a job started at {when}: moved its {len(previous)} file(s) to "
            f"{target} (lightning-elastic timeline {target} draws it)")


def _job_start(events: Path, files: list[Path]) -> float:
    """When the job that wrote ``files`` started: its first event, else its oldest file."""
    try:
        with open(events, encoding="utf-8") as f:
            return float(json.loads(f.readline())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return min(path.stat().st_mtime for path in files)

log = logging.getLogger("lightning_elastic.driver")


class EventLog:
    """Appends events to ``directory/events.jsonl``; with no directory, records nothing."""

    def __init__(self, directory: Path | None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._file: BackgroundLineFile | None = None
        self._path = directory / FILE_NAME if directory is not None else None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            # Written by a thread of its own: events are emitted with the registry's lock held.
            self._file = BackgroundLineFile(directory / FILE_NAME, self._stopped_by)
        # What the registry showed at the last observe(): new facts become events.
        # Round numbers (a round breaks once): as bounded as the registry's tables they follow.
        self._breaks_seen: set[int] = set()
        self._first_steps_seen: set[int] = set()
        self._reset_cause: dict[int, tuple[str, float]] = {}  # next round -> (what, when)

    def emit(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"time": round(fields.pop("time", None) or self._clock(), 6), "kind": kind, **fields}
        self._file.append(json.dumps(record, separators=(",", ":")) + "\n")

    def _stopped_by(self, err: OSError) -> None:
        # A full disk or a file-size limit costs the timeline, never the job.
        log.warning("The job's timeline stops here: %s could not be written (%s).", self._path, err)

    def resume(self, current_round: int) -> None:
        """An adopted job (``--state-dir``): the previous driver already recorded the first
        steps of the rounds up to ``current_round``."""
        self._first_steps_seen.update(range(1, current_round + 1))

    def host_change_announced(self, round_number: int, generation: int) -> None:
        self.emit("reset_announced", round=round_number, generation=generation)
        self._reset_cause.setdefault(round_number + 1, ("host change", self._clock()))

    def round_formed(self, number: int, members: list[dict[str, Any]]) -> None:
        self.emit("round_formed", round=number, size=len(members), members=members)

    def observe(self, breaks: Iterable[Any], first_steps: dict[int, float], current_round: int) -> None:
        """Turn what the registry learnt since the last call into events (driver lock held).
        ``breaks`` and ``first_steps`` hold the newest rounds only (``registry.ROUNDS_KEPT``)."""
        seen = self._breaks_seen
        for b in breaks:
            if b.round in seen:
                continue
            now = self._clock()
            self.emit("round_broken", round=b.round, cause=b.cause)
            # A fault outranks a host change announced just before it: recovery starts here.
            self._reset_cause[b.round + 1] = ("fault", now)
        self._breaks_seen = {b.round for b in breaks}
        for number in sorted(first_steps):
            if number in self._first_steps_seen or number > current_round:
                continue
            self._first_steps_seen.add(number)
            at = first_steps[number]
            self.emit("first_step", round=number, at=round(at, 6))
            cause = self._first_cause_before(number)
            if cause is not None:
                what, since = cause
                self.emit("recovery", round=number, after=what, since=round(since, 6),
                          duration_s=round(max(0.0, at - since), 6))
        if len(self._first_steps_seen) > 2 * ROUNDS_KEPT:  # older rounds are never reported again
            self._first_steps_seen = {n for n in self._first_steps_seen if n >= current_round - ROUNDS_KEPT}

    def _first_cause_before(self, number: int) -> tuple[str, float] | None:
        """What ended the round before ``number``: rounds numbers are consecutive, but a
        cause recorded for a round that never formed (a re-planned world) carries over."""
        causes = [k for k in self._reset_cause if k <= number]
        if not causes:
            return None
        key = max(causes)
        cause = self._reset_cause[key]
        for k in causes:
            del self._reset_cause[k]
        return cause

    def close(self) -> None:
        """Write what is queued (bounded: a stalled disk cannot hold the driver's exit)."""
        if self._file is not None:
            self._file.close()
            if self._file.dropped:
                log.warning("%d event(s) were not written to %s: the disk did not keep up.",
                            self._file.dropped, self._path)
            self._file = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of ``path`` (``events.jsonl`` or the directory holding it), in file order."""
    if path.is_dir():
        path = path / FILE_NAME
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON event ({err.msg})") from None
    return events
