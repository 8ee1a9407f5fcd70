"""The job's restartable state taken from a running driver (``snapshot``, read under its
lock; ``Snapshot.state`` builds it in the writer thread) and given back to
a new one (``restore``): the two halves of ``--state-dir``.

Both are plain functions of the driver's parts, so that what a restart needs is explicit:
the registry's workers and current round, the planned target, the blacklist, and the
counters the summary reports. What is not here starts afresh on restart, on purpose:
pending requests (workers send them again), the process-group store (a new round makes
new keys), timers that only bound a wait (a worker's heartbeat deadline starts at the
adoption, as if it had just been started).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

from lightning_elastic.launcher.job.history import BoundedHistory
from lightning_elastic.launcher.job.blacklist import HostManager
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.processes.base import WorkerProcess
from lightning_elastic.launcher.job.state import JobState, RoundInfo, Tally, WorkerRecord, WorkerState
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.restart.state_dir import (
    BlacklistEntry,
    FirstExitEntry,
    HoldEntry,
    SavedState,
    RoundEntry,
    StateDir,
    StateWriter,
    TargetEntry,
    WorkerEntry,
)
from lightning_elastic.protocol import Assignment, Outcome, Report


@dataclasses.dataclass(frozen=True)
class Counters:
    """What the job summary counts, carried across restarts."""

    next_worker: int
    rounds: tuple[int, ...]
    failures: tuple[str, ...]
    blacklisted: tuple[str, ...]
    departures: tuple[str, ...]
    outages: tuple[str, ...]
    # Entries the bounded histories above no longer hold (the reset limit counts them too).
    rounds_omitted: int = 0
    failures_omitted: int = 0
    departures_omitted: int = 0


def counters_of(tally: Tally) -> Counters:
    return Counters(tally.next_worker, tuple(tally.rounds), tuple(tally.failures), tuple(tally.blacklisted),
                    tuple(tally.departures), tuple(tally.outages), tally.rounds.omitted, tally.failures.omitted,
                    tally.departures.omitted)


def tally_of(saved: SavedState) -> Tally:
    """The previous driver's counts, from its saved state (what it kept of each history)."""
    return Tally(max(saved.next_worker, saved.reserved_worker), BoundedHistory.of(saved.rounds, saved.rounds_omitted),
                 BoundedHistory.of(saved.failures, saved.failures_omitted), list(saved.blacklisted),
                 BoundedHistory.of(saved.departures, saved.departures_omitted), list(saved.outages))


def waits_of(state: JobState) -> Waits:
    """What the driver is waiting out, as a save carries it."""
    return Waits(state.standby, tuple(state.held_until.items()), state.first_exit)


@dataclasses.dataclass(frozen=True)
class Waits:
    """What the driver is waiting out, in the driver's clock (``time.monotonic``): carried
    across a restart as seconds left or elapsed, so that the next driver's clock can differ."""

    standby: tuple[SlotKey, ...] = ()  # hot spares' slots (--spares)
    held_until: tuple[tuple[SlotKey, float], ...] = ()  # a preempted slot, the end of its hold
    first_exit: tuple[float, str] | None = None  # (since, worker): training returned, it exited


# A save is handed to the writer thread and never waited for: the driver may announce a round
# (or a generation) that is not on disk yet. Each save reserves this many more of both; an
# adopting driver that finds its workers ahead of its saved round jumps past the reserve
# (``Registry.note_ahead``), which holds unless this many changes were announced while one
# save was being written (one save takes 0.1-0.2 s at 4,096 workers; one change, a decision
# pass and the workers' answers, takes longer).
RESERVED_CHANGES = 64


def reserved_workers(workers: int, target: int) -> int:
    """Worker numbers a save reserves past the next one: what a driver may start before its
    next save lands. A decision pass starts at most one worker per slot of the target (hot
    spares included among the workers); twice the larger of the two, plus a margin, covers
    a pass and its replacements within one save's window (~1 s at 4,096 workers).

    A worker started and not saved before its driver died is unknown to the successor: its
    requests are refused and it exits. Were its number given again, the successor would
    take that orphan's requests for its own new worker's.
    """
    return RESERVED_CHANGES + 2 * max(workers, target)


# One worker as read under the lock: (id, slot, its process, joined, member of the current
# round, assignment, report, leave, ended state or "", standby). Only references to values
# that are never changed in place (assignments, reports, slots are frozen): the record may
# change after, the row does not.
_Row = tuple[str, SlotKey, WorkerProcess | None, bool, bool, Assignment | None, Report | None, bool, str, bool]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The job's state as read under the driver's lock, as cheaply as it can be read (a
    tuple of references per worker, ~2 ms at 4,096 workers); ``state()`` builds the
    ``SavedState`` from it, in the writer thread (~15 ms at 4,096 workers), so that a save
    holds the lock, and so delays the announcement of the round it saves, no longer than
    the reading."""

    address: str
    port: int
    next_worker: int
    generation: int
    round: RoundInfo | None
    broken_rounds: tuple[int, ...]
    rows: tuple[_Row, ...]
    target: tuple[SlotAssignment, ...]
    announced: bool
    counters: Counters
    blacklist: tuple[tuple[str, int | None, int, float | None], ...]
    waits: Waits
    now: float

    def state(self) -> SavedState:
        workers = []
        for worker_id, slot, proc, joined, member, assignment, report, leave, finished, standby in self.rows:
            # (pid, start ticks) of what outlives the driver; None: nothing can be adopted.
            pid, ticks = getattr(proc, "adoptable", None) or (0, 0)
            log_file = getattr(proc, "log_file", None)
            workers.append(WorkerEntry(
                worker_id=worker_id,
                host=slot.host,
                local_rank=slot.local_rank,
                pid=pid,
                start_ticks=ticks,
                joined=joined,
                member=member,
                assignment=assignment,  # immutable: shared, serialized by the writer thread
                reported=report.outcome.value if report else "",
                reported_round=report.round if report else 0,
                report_message=report.message if report else "",
                leave=leave,
                log_file=str(log_file) if log_file else "",
                finished=finished,
                standby=standby,
            ))
        current, counters, waits, now = self.round, self.counters, self.waits, self.now
        return SavedState(
            address=self.address,
            port=self.port,
            next_worker=counters.next_worker,
            generation=self.generation,
            round=RoundEntry(current.number, current.generation, current.members) if current else None,
            broken_rounds=self.broken_rounds,
            workers=tuple(workers),
            target=tuple(TargetEntry(a.slot.host, a.slot.local_rank, a.rank, a.size, a.local_size, a.cross_rank,
                                     a.cross_size) for a in self.target),
            announced=self.announced,
            rounds=counters.rounds,
            failures=counters.failures,
            blacklisted=counters.blacklisted,
            blacklist=tuple(BlacklistEntry(*entry) for entry in self.blacklist),
            departures=counters.departures,
            outages=counters.outages,
            rounds_omitted=counters.rounds_omitted,
            failures_omitted=counters.failures_omitted,
            departures_omitted=counters.departures_omitted,
            saved_at=time.time(),
            standby=waits.standby,
            holds=tuple(HoldEntry(slot.host, slot.local_rank, until - now) for slot, until in waits.held_until
                        if until > now),
            first_exit=FirstExitEntry(waits.first_exit[1], now - waits.first_exit[0]) if waits.first_exit else None,
            reserved_round=(current.number if current else 0) + RESERVED_CHANGES,
            reserved_generation=self.generation + RESERVED_CHANGES,
            reserved_worker=counters.next_worker + reserved_workers(len(self.rows), len(self.target)),
        )


def snapshot(
    address: str,
    port: int,
    registry: Registry,
    processes: Mapping[str, WorkerProcess],
    target: Sequence[SlotAssignment],
    announced: bool,
    hosts: HostManager,
    counters: Counters,
    waits: Waits = Waits(),
    now: float | None = None,
) -> Snapshot:
    """Read the state a restarted driver needs (driver lock held; O(workers), references only)."""
    current = registry.state.round
    number = current.number if current is not None else -1
    member_state = WorkerState.MEMBER
    get = processes.get
    rows: list[_Row] = []
    for record in registry.state.workers.values():
        state = record.state
        if state.finished:
            continue
        a = record.assignment
        rows.append((record.worker_id, record.slot, get(record.worker_id), record.joined,
                     state is member_state and a is not None and a.round == number,
                     a, record.report, record.leave, "", record.standby))
    if current is not None:  # its finished members too: the round names them
        for worker_id in current.members:
            record = registry.state.workers[worker_id]
            if record.state.finished:
                rows.append((worker_id, record.slot, get(worker_id), record.joined, False, record.assignment,
                             record.report, record.leave, record.state.value, record.standby))
    return Snapshot(
        address, port, counters.next_worker, registry.state.generation, current, tuple(sorted(registry.state.broken_rounds)),
        tuple(rows), tuple(target), announced, counters, tuple(hosts.blacklist_entries()), waits,
        time.monotonic() if now is None else now)


@dataclasses.dataclass
class Restored:
    processes: dict[str, WorkerProcess]
    target: list[SlotAssignment]
    adopted: int  # workers found running
    ended: int  # workers that ended while no driver ran (reaped as usual, failures included)
    waits: Waits = Waits()  # in the new driver's clock


def restore(
    state: SavedState,
    registry: Registry,
    hosts: HostManager,
    adopt: Callable[[WorkerEntry, Callable[[], str]], WorkerProcess],
    prefix_for: Callable[[WorkerRecord], Callable[[], str]],
    now: float | None = None,
) -> Restored:
    """Give ``registry`` and ``hosts`` the previous driver's job, and find its workers'
    processes again through ``adopt`` (driver lock held, before the service starts)."""
    processes: dict[str, WorkerProcess] = {}
    adopted = ended = 0
    for w in state.workers:
        record = registry.add_worker(w.worker_id, SlotKey(w.host, w.local_rank))
        record.joined = w.joined
        record.leave = w.leave
        record.standby = w.standby
        # Its heartbeat deadline starts now (a worker that never joined gets its start-up bound).
        record.last_heartbeat = record.started_at if w.joined else None
        record.assignment = w.assignment
        if w.member:
            record.state = WorkerState.MEMBER
        if w.reported:
            record.report = Report(w.worker_id, w.reported_round, Outcome(w.reported), w.report_message)
            record.reported_at = record.started_at  # its exit's bound starts now, as the heartbeat's does
        if w.finished:
            record.state = WorkerState(w.finished)
            continue  # no process to find: it has been reaped
        proc = adopt(w, prefix_for(record))
        processes[w.worker_id] = proc
        if proc.poll() is None:
            adopted += 1
        else:
            ended += 1
    registry.state.generation = state.generation
    registry.state.reserved = (max(state.reserved_round, state.round.number if state.round else 0),
                         max(state.reserved_generation, state.generation))
    registry.state.broken_rounds = set(state.broken_rounds)
    if state.round is not None:
        members = state.round.members
        registry.state.round = RoundInfo(state.round.number, members, state.round.generation,
                                   tuple(registry.state.workers[m].slot for m in members if m in registry.state.workers))
    hosts.restore_blacklist([(b.host, b.local_rank, b.count, b.remaining) for b in state.blacklist])
    target = [SlotAssignment(SlotKey(t.host, t.local_rank), t.rank, t.size, t.local_size, t.cross_rank, t.cross_size)
              for t in state.target]
    now = time.monotonic() if now is None else now
    # A hold or the exit timeout goes on from where it was: the outage does not count
    # (as the blacklist's cooldowns), so a restart never cuts a wait short.
    waits = Waits(
        standby=state.standby,
        held_until=tuple((SlotKey(h.host, h.local_rank), now + h.remaining) for h in state.holds),
        first_exit=(now - state.first_exit.elapsed, state.first_exit.worker_id) if state.first_exit else None,
    )
    return Restored(processes, target, adopted, ended, waits)


# A save (a snapshot under the driver's lock, then the state, JSON and a rename in the writer thread)
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

    def __init__(self, state_dir: StateDir,
                 adopt: Callable[[WorkerEntry, Callable[[], str]], WorkerProcess] | None = None) -> None:
        self.dir = state_dir
        # Finds a worker of the previous driver again: its launcher's ``adopt`` (local or ssh).
        self.adopt = adopt
        self.previous = state_dir.load()  # the job to adopt; None: a new job
        self.secret = state_dir.secret()
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
