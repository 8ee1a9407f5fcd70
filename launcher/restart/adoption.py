"""Giving a new driver the job a previous one left (``restore``), and when and how a
running driver keeps it in ``--state-dir`` (``SavePacing``, ``StateKeeping``).

What is saved is the job's ``JobState`` itself (``state_codec``); ``restore`` puts it back
and applies the adoption rules, so that what a restart changes is explicit:

- timers that only bound a wait start afresh: a worker's heartbeat deadline, its start-up
  bound and the bound on its exit after its report start at the adoption, as if it had just
  been started; a hold, the --exit-timeout, a stop's SIGKILL deadline and the blacklist's
  cooldowns go on with the time they had left (the outage does not count);
- what a restarted driver learns again at once is not saved (``transient``): pending
  requests (workers send them again: a worker not in the current round asks for a round
  anew), the process-group store (a new round makes new keys), what discovery lists;
- numbers its predecessor may have used unsaved are not used again (``RESERVED_CHANGES``,
  ``reserved_workers``);
- finished workers are kept (the round names them, the verdict counts them), each live
  worker's process is found again through its launcher's ``adopt``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from lightning_elastic.launcher.job.state import JobState, WorkerRecord, WorkerState
from lightning_elastic.launcher.processes.base import WorkerProcess
from lightning_elastic.launcher.restart import state_codec
from lightning_elastic.launcher.restart.state_dir import StateDir, StateWriter
from lightning_elastic.launcher.service.long_poll import Signal
from lightning_elastic.launcher.service.registry import Registry

# Finds the process of a worker a previous driver started (its launcher's ``adopt``): from its
# record (host, keeper pid and start ticks, log file) and the prefix of its output lines.
Adopt = Callable[[WorkerRecord, Callable[[], str]], WorkerProcess]

# A save is handed to the writer thread and never waited for: the driver may announce a round
# (or a generation) that is not on disk yet. An adopting driver reserves this many more of
# both past the saved ones; one that finds its workers ahead of its saved round jumps past
# the reserve (``Registry._note_ahead``), which holds unless this many changes were announced
# while one save was being written (one save takes 0.1-0.2 s at 4,096 workers; one change,
# a decision pass and the workers' answers, takes longer).
RESERVED_CHANGES = 64


def reserved_workers(workers: int, target: int) -> int:
    """Worker numbers an adopting driver skips past the saved next one: what its predecessor
    may have started before its next save landed. A decision pass starts at most one worker
    per slot of the target (hot spares included among the workers); twice the larger of the
    two, plus a margin, covers a pass and its replacements within one save's window (~1 s
    at 4,096 workers).

    A worker started and not saved before its driver died is unknown to the successor: its
    requests are refused and it exits. Were its number given again, the successor would
    take that orphan's requests for its own new worker's.
    """
    return RESERVED_CHANGES + 2 * max(workers, target)


@dataclasses.dataclass
class Restored:
    processes: dict[str, WorkerProcess]  # the live workers' processes, found again
    adopted: int  # workers found running
    ended: int  # workers that ended while no driver ran (reaped as usual, failures included)


def restore(saved: JobState, registry: Registry, adopt: Adopt,
            prefix_for: Callable[[WorkerRecord], Callable[[], str]], now: float) -> Restored:
    """Make ``registry``'s job the one ``saved`` (as ``StateDir.load`` read it: its clock
    times from the save), under the adoption rules of the module docstring, and find each
    live worker's process again through ``adopt`` (driver lock held, before the service
    starts). ``saved`` becomes part of the registry's state: it is not to be used after."""
    state_codec.rebase(saved, now)  # on this driver's clock: what was left of a wait is left
    job = registry.state
    for name in state_codec.persisted_fields(JobState):  # the job's own object: the driver's parts hold it
        setattr(job, name, getattr(saved, name))
    job.hosts.use(job.blacklist)
    current = job.round
    job.reserved = (max(current.number if current is not None else 0, job.round_floor) + RESERVED_CHANGES,
                    job.generation + RESERVED_CHANGES)
    job.tally.next_worker += reserved_workers(len(job.workers), len(job.target))
    processes: dict[str, WorkerProcess] = {}
    adopted = ended = 0
    for record in job.workers.values():
        record.wake = Signal()  # the service's, for its pending requests (none yet)
        record.started_at = now
        record.last_heartbeat = now if record.joined else None  # else it has its start-up bound
        record.reported_at = now if record.report is not None else None
        record.adopted = True
        if record.state.finished:
            continue  # reaped already: no process to find
        if not job.current_member(record):
            record.state = WorkerState.STARTING  # whatever it asked the last driver, it asks again
        proc = adopt(record, prefix_for(record))
        processes[record.worker_id] = proc
        if proc.poll() is None:
            adopted += 1
        else:
            ended += 1
    registry.note_change()
    return Restored(processes, adopted, ended)


# A save (a capture under the driver's lock, then the JSON and a rename in the writer thread)
# may take this share of the time at most: at 4,096 workers a save costs ~0.15 s of CPU,
# and a save after every decision pass (a fleet reporting its end, one pass per few exits)
# left the service so little of the lock that heartbeats went unrecorded.
SAVE_SHARE = 0.1


class SavePacing:
    """When the driver saves its state: no sooner than the last save's cost divided by
    ``SAVE_SHARE`` after it (immediately at tens of workers; ~1 s apart at 4,096). A new
    round (or generation) likewise waits that long after it changed, not after the last
    save: it is announced first, as every member asks for it at once, the service's busiest
    moment, which a save (its CPU, in a thread of the same process) would slow down. Nothing
    needs it on disk sooner: a driver that dies before it is saved leaves a successor that
    the workers tell of it, and that re-forms past it (``Registry._note_ahead``).
    A change not saved yet stays due: the loop asks again every turn."""

    def __init__(self, share: float = SAVE_SHARE) -> None:
        self._share = share
        self._pending = False
        self._next = 0.0
        self._wait = 0.0  # the last save's cost / share
        self._saved_round: tuple[int, int] | None = None
        self._new_round: tuple[tuple[int, int], float] | None = None  # (round key, when first seen)

    def changed(self) -> None:
        self._pending = True

    def due(self, now: float, round_key: tuple[int, int]) -> bool:
        if not self._pending:
            return False
        if round_key == self._saved_round:
            return now >= self._next
        if self._new_round is None or self._new_round[0] != round_key:
            self._new_round = (round_key, now)
        return now >= self._new_round[1] + self._wait

    def saved(self, now: float, round_key: tuple[int, int], cost: float) -> None:
        """A save was handed over at ``now``; it took ``cost`` s (reading + the last write)."""
        self._pending = False
        self._saved_round = round_key
        self._new_round = None
        self._wait = cost / self._share
        self._next = now + self._wait


# How far a worker's clock may lag the driver's: an adopting driver accepts requests signed
# this long before it started (in whole seconds, as requests are stamped). An outage longer
# than about twice this leaves no request its predecessor saw acceptable.
CLOCK_SKEW = 1.0


def not_before(started: float) -> int:
    """The oldest request timestamp an adopting driver started at ``started`` accepts."""
    return math.floor(started - CLOCK_SKEW)


class StateKeeping:
    """One driver's ``--state-dir``: the locked directory, the job it adopts (if any), and
    the writer that keeps the state there while the job runs."""

    def __init__(self, state_dir: StateDir, adopt: Adopt | None = None, secret: str | None = None) -> None:
        self.dir = state_dir
        # Finds a worker of the previous driver again: its launcher's ``adopt`` (local, ssh, agent).
        self.adopt = adopt
        self.previous = state_dir.load()  # the job to adopt (clock times from its save); None: a new job
        # The job's secret: given (--agents: the --secret-file the agents hold too, the same
        # for every driver of the job), else the one saved in the state dir.
        self.secret = secret if secret is not None else state_dir.secret()
        last = state_dir.last_alive()
        # How long no driver ran: since the previous one last touched ``alive``.
        self.outage = max(0.0, time.time() - last) if self.previous is not None and last is not None else 0.0
        self.writer = StateWriter(state_dir)
        self.started = time.time()  # wall clock: compared with the workers' request timestamps

    def finish(self, job_over: bool) -> None:
        """The driver is exiting: with the job over, nothing is left to adopt."""
        self.writer.close()
        if job_over:
            self.dir.clear()


class AdoptionWatch:
    """Until every adopted worker has reached the new driver (a heartbeat or any request
    since the adoption): then how long that took from the driver's start."""

    def __init__(self, records: list[WorkerRecord], adopted_at: float, driver_started: float) -> None:
        self._pending = list(records)
        self._adopted_at = adopted_at
        self._driver_started = driver_started
        self._last = adopted_at  # the latest arrival seen so far

    def check(self, now: float) -> float | None:
        """Seconds from the driver's start to the last adopted worker's arrival, once all have
        arrived (or ended); else None. O(workers not yet arrived): asked every tick until then.
        The arrival's own time, not this check's: the loop may look a tick later."""
        pending = []
        for r in self._pending:
            if r.state.finished:
                continue
            if r.last_heartbeat is None or r.last_heartbeat <= self._adopted_at:
                pending.append(r)
            else:  # its first request since (a later one may have come since: within a tick)
                self._last = max(self._last, r.last_heartbeat)
        self._pending = pending
        return None if pending else self._last - self._driver_started
