"""The driver's view of its workers and rounds, shared by the driver loop and the rendezvous service.

One object owns this runtime state and one lock guards it. The rendezvous service's request
handlers record what workers say and wait (bounded) for the driver loop's decisions; the
driver loop makes every membership decision. What a worker's request proves at once is
recorded at once: a member back at the rendezvous unannounced, or one leaving after a
collective error, breaks its round (so its peers hear it without waiting for a tick), and
an error is answered by ``classify_error``.

Waking is targeted, so that the cost of an event does not grow with the fleet: a worker's
pending requests are ``LongPoll``s on its own ``Signal``, fired only by what may change
their answer (its round formed, it must leave, a host change or a broken round for all);
the driver loop's ``cond`` is notified by what the driver acts on, and by an arrival only
once every arrival it awaits has come (``await_arrivals``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum

from lightning_elastic.launcher.config import MAX_LOST_MEMBER_WAIT
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.service.long_poll import LongPoll, Signal
from lightning_elastic.protocol import (
    Assignment,
    HeartbeatReply,
    LeaveReply,
    LeaveRequest,
    HeartbeatRequest,
    Outcome,
    RendezvousReply,
    RendezvousRequest,
    RendezvousStatus,
    Report,
    RoundLostReply,
    RoundLostRequest,
    RENDEZVOUS_POLL,
)


log = logging.getLogger("lightning_elastic.driver")

# An error is compared by its first characters (numbers masked): the worker sends its last
# traceback line, and nothing from the network is kept unbounded.
MAX_ERROR_CHARS = 500


class WorkerState(str, Enum):
    """Life cycle of a worker, as the driver sees it.

    STARTING -> WAITING (asked for a round) -> MEMBER (in the current round) -> WAITING ...
    and finally DONE (reported that training returned, then exited), REMOVED (left because
    its slot was taken out of the job, or was stopped by the driver) or FAILED (exited
    without reporting success, or was killed as wedged).
    """

    STARTING = "starting"
    WAITING = "waiting"
    MEMBER = "member"
    DONE = "done"
    REMOVED = "removed"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        # Identity, not ``in (...)``: an Enum's __eq__/__hash__ are Python-level, and the
        # driver asks this of every worker several times per decision.
        return self is WorkerState.DONE or self is WorkerState.REMOVED or self is WorkerState.FAILED


class UnknownWorker(LookupError):
    """A request from a worker the registry does not count. ``ended``: one it counted until
    it finished (a heartbeat sent just before its exit, answered after it was reaped), not a
    stranger: answered the same, but no rejection of note."""

    def __init__(self, message: str, ended: bool = False) -> None:
        super().__init__(message)
        self.ended = ended


@dataclasses.dataclass
class WorkerRecord:
    worker_id: str
    slot: SlotKey
    started_at: float
    state: WorkerState = WorkerState.STARTING
    assignment: Assignment | None = None
    arrived_after_round: int | None = None  # set while it waits at the rendezvous
    waiting_since: float | None = None
    last_heartbeat: float | None = None
    asking_round: int | None = None  # set while it asks whether its round lost a member
    report: Report | None = None
    # When its report arrived: it stops heartbeating to exit then, and --exit-timeout, not
    # the heartbeat timeout, bounds the exit (the group's teardown, the interpreter's end).
    reported_at: float | None = None
    leave: bool = False  # answer EXIT at its next rendezvous
    departing: str = ""  # why it asked to leave (a preemption notice): its slot is vacant
    # The driver is stopping it (SIGTERM, or SIGKILL for a wedged one): SIGKILL at this time.
    stop_deadline: float | None = None
    kill_reason: str = ""  # why the driver killed or stopped it: part of its failure
    failure: str = ""  # how it failed ("worker ID <how>"), once it has
    standby: bool = False  # a hot spare (--spares): waits at the rendezvous, in no round
    joined: bool = False  # has reached the rendezvous at least once (le.init() ran)
    exit_status: int | None = None
    # Durable snapshots it wrote and failed to write, and the newest failure (heartbeats).
    snapshots: tuple[int, int, str] = (0, 0, "")
    # Its pending requests wait on this: fired when their answers may have changed.
    wake: Signal = dataclasses.field(default_factory=Signal, repr=False, compare=False)

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None

    @property
    def reported_done(self) -> bool:
        return self.report is not None and self.report.outcome == Outcome.DONE

    @property
    def rank(self) -> int | None:
        return self.assignment.rank if self.assignment and self.state == WorkerState.MEMBER else None


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    number: int
    members: tuple[str, ...]  # worker ids in rank order
    generation: int
    slots: tuple[SlotKey, ...] = ()  # the members' slots, in rank order


@dataclasses.dataclass(frozen=True)
class RoundBreak:
    """How a round ended early: the first fact that broke it."""

    round: int
    slots: tuple[SlotKey, ...]  # the round's members
    cause: str  # for the log and the verdict
    error: str = ""  # the collective error a member left the round with; "" when a member was lost
    commits: int = 0  # commits the round made before the error


# Facts kept per round (its break, its first step, its verdicts) for this many rounds back:
# a job of weeks with a host that keeps failing forms thousands of rounds, and a break of a
# round of 4,096 holds its 4,096 slots. Nothing asks about a round this old.
ROUNDS_KEPT = 64


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic, repeated_error_limit: int = 3) -> None:
        self._clock = clock
        self._repeated_error_limit = repeated_error_limit
        # One lock for the driver loop and every request. ``cond`` is the driver loop's, woken
        # by what the driver acts on; requests wait on their worker's own signal.
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)
        # Groups of worker ids whose arrival at the rendezvous the driver awaits (see
        # await_arrivals); None: every arrival wakes the driver.
        self._awaited: list[set[str]] | None = None
        self._asking: set[str] = set()  # workers with a round-lost request pending
        # Bumped whenever the driver is notified of a request: the driver re-plans only
        # when it moved (or a timer is due), not on every tick.
        self.changes = 0
        # Bumped by every report, noted or not: a report that needs no decision (see
        # ``report``) still belongs in the state a --state-dir driver saves.
        self.reports = 0
        # The round in which a member first reported that training returned: later DONE
        # reports of that round decide nothing until their worker exits.
        self._returned_in: int | None = None
        self.workers: dict[str, WorkerRecord] = {}
        self.round: RoundInfo | None = None
        self.generation = 0
        self.broken_rounds: set[int] = set()
        # In round order; the newest ROUNDS_KEPT (or the repeated-error limit, if more).
        self.breaks: collections.deque[RoundBreak] = collections.deque(maxlen=max(ROUNDS_KEPT, repeated_error_limit))
        # Round -> the earliest first training step any member reported in it (wall clock).
        self.first_steps: dict[int, float] = {}
        # Set once the same collective error has ended too many rounds: the job's end.
        self.repeated_error: str | None = None
        self.closing = False  # the driver is shutting down: no graceful leaves any more
        # Rounds in which every live member once asked round_lost at the same time: the same
        # error everywhere is the user's own. Sticky, so members answered later agree.
        self.user_error_rounds: set[int] = set()
        # Round -> the errors (normalized) of members told their error is their own: they
        # are leaving it. A later asker with the same error has it too (everyone's error,
        # raised a little later); one with another error lost that member. Current and
        # previous round only.
        self._own_errors: dict[int, set[str]] = {}
        # The one asker whose round's other members are called in to show they are alive
        # (see round_lost_poll), and when the latest call-in began: a heartbeat parked
        # before then answers at once, so that its worker sends a fresh one.
        self._checking: CheckIn | None = None
        self._called_in_at = float("-inf")
        # An adopting driver's only (None otherwise): the (round, generation) its predecessor
        # may have announced unsaved (``JobState.reserved_*``); once a worker shows it knows
        # more than the saved round (``_note_ahead``), the next ones are numbered past them.
        self.reserved: tuple[int, int] | None = None
        self._round_floor = 0

    # ----- driver side (call with self.cond held) -------------------------------------

    def add_worker(self, worker_id: str, slot: SlotKey) -> WorkerRecord:
        record = WorkerRecord(worker_id, slot, started_at=self._clock())
        self.workers[worker_id] = record
        self.note_change()
        return record

    def wake(self, record: WorkerRecord) -> None:
        """The driver changed this worker's fate (told it to leave, stopped or reaped it):
        its pending requests must look again."""
        record.wake.fire()

    def wake_all(self) -> None:
        """Wake every pending request and the driver loop (the driver is stopping)."""
        for record in self.workers.values():
            record.wake.fire()
        self.cond.notify_all()

    def await_arrivals(self, *groups: set[str]) -> None:
        """Wake the driver on an arrival only once every worker of one of ``groups`` has
        arrived (the whole target world: a round to form; the joiners: a change to
        announce). At thousands of workers, a decision per arrival would cost the driver
        N decisions of O(N) each. No groups: wake it on every arrival."""
        self._awaited = [set(g) for g in groups if g] if groups else None

    def note_change(self) -> None:
        """Something the driver must decide on happened: wake its loop for a decision pass."""
        self.changes += 1
        self.cond.notify_all()

    def _fire_live(self) -> None:
        for record in self.workers.values():
            if not record.state.finished:
                record.wake.fire()

    def _fire_askers(self) -> None:
        for worker_id in self._asking:
            self.workers[worker_id].wake.fire()

    def forget_finished(self, keep: set[str]) -> list[str]:
        """Drop the records of finished workers outside ``keep`` (the round just formed);
        their ids, for the caller's own tables. A job replacing workers for weeks would
        otherwise hold, and scan on every tick, every worker it ever started. A request
        still in flight from one (it exited) is then refused as from an unknown worker."""
        gone = [w for w, record in self.workers.items() if record.state.finished and w not in keep]
        for worker_id in gone:
            del self.workers[worker_id]
            self._asking.discard(worker_id)
        return gone

    def live_workers(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if not w.state.finished]

    def bump_generation(self) -> int:
        self.generation += 1
        self.note_change()
        self._fire_live()  # every heartbeat long poll answers at once
        return self.generation

    def mark_round_broken(self, number: int, cause: str = "a member was lost", error: str = "", commits: int = 0) -> bool:
        """Record that round ``number`` lost a member; False if it was already broken."""
        if number in self.broken_rounds:
            return False
        self.broken_rounds.add(number)
        slots = self.round.slots if self.round is not None and self.round.number == number else ()
        self.breaks.append(RoundBreak(number, slots, cause, error, commits))
        log.info("Round %d is broken: %s.", number, cause)
        if self.repeated_error is None:
            self.repeated_error = repeated_collective_error(list(self.breaks), self._repeated_error_limit)
        self.note_change()
        self._fire_live()  # heartbeats and round-lost verdicts answer at once
        return True

    def current_member(self, record: WorkerRecord) -> bool:
        # By its assignment, not ``in self.round.members``: a scan of the members on every
        # arrival made re-forming thousands of workers quadratic.
        a = record.assignment
        return (self.round is not None and record.state == WorkerState.MEMBER and a is not None
                and a.round == self.round.number)

    def form_round(
        self, members: list[tuple[WorkerRecord, SlotAssignment]], store: tuple[str, int]
    ) -> RoundInfo:
        number = max(self.round.number if self.round else 0, self._round_floor) + 1
        for record, slot in members:
            record.assignment = Assignment(
                round=number,
                rank=slot.rank,
                size=slot.size,
                local_rank=slot.slot.local_rank,
                local_size=slot.local_size,
                cross_rank=slot.cross_rank,
                cross_size=slot.cross_size,
                hostname=slot.slot.host,
                store_host=store[0],
                store_port=store[1],
                generation=self.generation,
            )
            record.state = WorkerState.MEMBER
            record.arrived_after_round = None
            record.waiting_since = None
        self.round = RoundInfo(
            number, tuple(r.worker_id for r, _ in members), self.generation, tuple(r.slot for r, _ in members)
        )
        for old in [r for r in self._own_errors if r < number - 1]:
            del self._own_errors[old]
        self._forget_rounds_before(number - ROUNDS_KEPT)
        self.note_change()
        for record, _ in members:
            record.wake.fire()
        self._fire_askers()  # asking about the previous round: "all members asking" changed
        return self.round

    def _forget_rounds_before(self, oldest: int) -> None:
        """Per-round facts stay bounded over a job of weeks (``breaks`` is a bounded deque)."""
        self.broken_rounds = {n for n in self.broken_rounds if n >= oldest}
        self.user_error_rounds = {n for n in self.user_error_rounds if n >= oldest}
        for n in [n for n in self.first_steps if n < oldest]:
            del self.first_steps[n]

    # ----- service side: each call records, then waits (bounded) for the driver -------

    def _get(self, worker_id: str) -> WorkerRecord:
        record = self.workers.get(worker_id)
        if record is None or record.state.finished:
            raise UnknownWorker(f"unknown or finished worker {worker_id!r}", ended=record is not None)
        return record

    def _poll(self, answer, record: WorkerRecord, timeout: float, finish=lambda: None) -> LongPoll:
        return LongPoll(self._lock, answer, record.wake, self._clock() + timeout, self._clock, finish)

    def rendezvous(self, request: RendezvousRequest, timeout: float = RENDEZVOUS_POLL) -> RendezvousReply:
        return self.rendezvous_poll(request, timeout).wait()

    def rendezvous_poll(self, request: RendezvousRequest, timeout: float = RENDEZVOUS_POLL) -> LongPoll[RendezvousReply]:
        with self.cond:
            record = self._get(request.worker_id)
            self._note_ahead(record, round_number=request.after_round)
            now = self._clock()
            record.last_heartbeat = now
            if not (self._assigned_after(record, request.after_round) and not record.leave):
                self._arrive(record, request.after_round, now)
            # else: a repeat of the request that got this assignment (the client retries
            # when the reply is lost): answered again below, rather than turning a member
            # into a waiting worker that no round will ever pick up again.

        def answer(final: bool) -> RendezvousReply | None:
            if record.leave:
                return RendezvousReply(RendezvousStatus.EXIT)
            if self._assigned_after(record, request.after_round):
                return RendezvousReply(RendezvousStatus.ASSIGNED, record.assignment)
            if final or record.state.finished:
                return RendezvousReply(RendezvousStatus.WAIT, standby=record.standby)
            return None

        return self._poll(answer, record, timeout)

    def _arrive(self, record: WorkerRecord, after_round: int, now: float) -> None:
        self._note_left_round(record, after_round)
        record.joined = True
        if record.arrived_after_round != after_round or record.state != WorkerState.WAITING:
            record.waiting_since = now
        record.arrived_after_round = after_round
        record.state = WorkerState.WAITING if not record.leave else record.state
        if self._awaited is None:
            self.note_change()
            return
        for group in self._awaited:
            if record.worker_id in group:
                group.discard(record.worker_id)
                if not group:
                    self.note_change()  # the last arrival of a group the driver waited for

    def _note_left_round(self, record: WorkerRecord, after_round: int) -> None:
        """A member back at the rendezvous with no change announced has left its round.

        Its peers cannot complete a collective without it (say its own collective timed
        out): for them it is lost, exactly as if it had exited.
        """
        current = self.round
        if (
            current is not None
            and after_round == current.number
            and self.current_member(record)
            and self.generation == current.generation
            and not record.leave
        ):
            self.mark_round_broken(current.number, f"worker {record.worker_id} left round {current.number}")

    def _note_ahead(self, record: WorkerRecord, generation: int = 0, round_number: int = 0) -> None:
        """A worker knows a generation or a round newer than this registry's.

        Only an adopting driver (``--state-dir``) can see this: its predecessor announced a
        change (a round, a host change) and died before the writer thread saved it, as a
        save is never waited for. What the saved round says of its members is then stale,
        a round numbered from it could reuse a number a worker already holds (it would
        never take it: ``_assigned_after``), and a generation bump could stay below one the
        workers know (they would not hear of it). So the saved round is broken, and the
        round numbers and generations jump past every one the predecessor may have used
        (``reserved``, and what the worker said): the workers re-form, as after a lost member.
        """
        if self.reserved is None:  # not adopted: every round and generation is this registry's own
            return
        current = self.round.number if self.round is not None else 0
        if generation <= self.generation and round_number <= max(current, self._round_floor):
            return
        log.warning("Worker %s knows round %d / generation %d, newer than this driver's saved round %d / "
                    "generation %d: the previous driver died before saving them; the workers re-form.",
                    record.worker_id, round_number, generation, current, self.generation)
        self._round_floor = max(self._round_floor, current, round_number, self.reserved[0])
        self.generation = max(self.generation, generation, self.reserved[1])
        if self.round is not None:
            self.mark_round_broken(current, f"the previous driver's last change was not saved "
                                            f"(worker {record.worker_id} knows round {round_number})")
        self.bump_generation()

    @staticmethod
    def _assigned_after(record: WorkerRecord, after_round: int) -> bool:
        """Is ``record`` a member of a round newer than the last one it knows?"""
        a = record.assignment
        return record.state == WorkerState.MEMBER and a is not None and a.round > after_round

    def heartbeat(self, request: HeartbeatRequest) -> HeartbeatReply:
        return self.heartbeat_poll(request).wait()

    def heartbeat_poll(self, request: HeartbeatRequest) -> LongPoll[HeartbeatReply]:
        with self.cond:
            record = self._get(request.worker_id)
            self._note_ahead(record, generation=request.known_generation)
            arrived = record.last_heartbeat = self._clock()
            checking = self._checking
            if checking is not None and record.assignment is not None and record.assignment.round == checking.round:
                asker = self.workers.get(checking.asker)
                if asker is not None:
                    asker.wake.fire()  # one more of its peers may have shown it is alive
            if request.snapshots_written or request.snapshots_failed:
                record.snapshots = (request.snapshots_written, request.snapshots_failed, request.snapshot_error[:200])
            if request.stepped_round > 0:
                known = self.first_steps.get(request.stepped_round)
                if known is None or request.stepped_at < known:
                    self.first_steps[request.stepped_round] = request.stepped_at
                    self.note_change()  # for the timeline

        def answer(final: bool) -> HeartbeatReply | None:
            # Answer early on a broken round too: a member blocked in a collective on a dead
            # peer (NCCL often hangs rather than fails) learns it a long poll sooner.
            broken = max(self.broken_rounds, default=0)
            if (final or self.generation > request.known_generation or broken > request.known_broken_round
                    or arrived < self._called_in_at):  # called in: the next heartbeat shows it alive
                return HeartbeatReply(self.generation, broken)
            return None

        return self._poll(answer, record, min(request.wait_seconds, RENDEZVOUS_POLL))

    def round_lost(self, request: RoundLostRequest) -> RoundLostReply:
        """Did ``request.round`` lose a member? Answers early both ways (see ``classify_error``).

        A collective error first breaks the round (its member leaves it whatever the answer).
        """
        return self.round_lost_poll(request).wait()

    def round_lost_poll(self, request: RoundLostRequest) -> LongPoll[RoundLostReply]:
        wait = min(request.wait_seconds, MAX_LOST_MEMBER_WAIT)
        key = normalize_error(request.error[:MAX_ERROR_CHARS]) if request.error else ""
        with self.cond:
            record = self._get(request.worker_id)
            self._note_ahead(record, round_number=request.round)
            record.asking_round = request.round
            self._asking.add(record.worker_id)
            now = record.last_heartbeat = self._clock()
            if self._all_members_asking(request.round):
                self._fire_askers()  # the others' answer changed: the same error everywhere
            current = self.round.number if self.round is not None else 0
            if request.collective and request.round == current:
                self.mark_round_broken(
                    request.round,
                    f"worker {record.worker_id} left round {request.round} after a collective error: {request.error}",
                    error=request.error or "collective error",
                    commits=request.commits,
                )
            elif self._may_call_in(request.round):
                self._call_in(record, request.round, now)

        def answer(final: bool) -> RoundLostReply | None:
            broken = request.round in self.broken_rounds
            # O(members): not asked of a broken round, whose answer does not need it (at
            # thousands of members, every one asks about the same broken round at once).
            all_asking = not broken and self._all_members_asking(request.round)
            own = self._own_errors.get(request.round, ())
            alike = bool(key) and key in own
            checking = self._checking
            view = ErrorView(
                broken=broken,
                judged_own=request.round in self.user_error_rounds,
                all_members_asking=all_asking,
                collective=request.collective,
                repeated_error=self.repeated_error,
                waited_out=final,
                failed_alike=alike,
                failed_other=bool(own) and not alike,
                others_alive=(checking is not None and checking.asker == record.worker_id
                              and self._others_shown_alive(checking)),
            )
            reply = classify_error(view)
            if reply is not None and all_asking and not reply.lost and not request.collective:
                # Sticky, so members answered later agree.
                self.user_error_rounds.add(request.round)
                self._fire_askers()
            if reply is not None and not reply.lost and not request.collective:
                # It leaves the round now: other askers' answers changed (see _own_errors).
                self._own_errors.setdefault(request.round, set()).add(key)
                self._fire_askers()
            return reply

        def finish() -> None:
            record.asking_round = None
            self._asking.discard(record.worker_id)
            if self._checking is not None and self._checking.asker == record.worker_id:
                self._checking = None

        return self._poll(answer, record, wait, finish)

    def leave(self, request: LeaveRequest) -> LeaveReply:
        """A worker got a preemption notice: let it leave at its next check, or not."""
        with self.cond:
            record = self._get(request.worker_id)
            if self.closing or record.stopping or record.reported_done:
                return LeaveReply(False)
            record.departing = request.reason or "preempted"
            record.leave = True
            self.note_change()
            return LeaveReply(True)

    def _may_call_in(self, number: int) -> bool:
        """Should an asker about round ``number`` call its peers in? Only about the current,
        unbroken round, before any member of it was told its error is its own (the answer
        then no longer needs it), and one asker at a time: at thousands of members, each
        call-in costs a heartbeat from every one of them."""
        return (self._checking is None and self.round is not None and self.round.number == number
                and number not in self.broken_rounds and number not in self._own_errors)

    def _call_in(self, record: WorkerRecord, number: int, now: float) -> None:
        """Ask every other live member of round ``number`` for a heartbeat now: one that
        sends it after ``record``'s question was alive after its error, so that error is
        not a consequence of that member's loss."""
        self._checking = CheckIn(record.worker_id, number, now)
        self._called_in_at = now
        assert self.round is not None
        for worker_id in self.round.members:
            member = self.workers.get(worker_id)
            if member is not None and member is not record and not member.state.finished:
                member.wake.fire()

    def _others_shown_alive(self, checking: CheckIn) -> bool:
        """Has every other live member of the checked round sent a request since the
        question? Members stay shown alive, so the scan resumes where it stopped: O(members)
        for the whole wait, however many heartbeats wake it."""
        if self.round is None or self.round.number != checking.round:
            return False
        members = self.round.members
        while checking.cursor < len(members):
            member = self.workers.get(members[checking.cursor])
            if not (member is None or member.state.finished or member.worker_id == checking.asker
                    or (member.last_heartbeat is not None and member.last_heartbeat > checking.since)):
                return False
            checking.cursor += 1
        return True

    def _all_members_asking(self, number: int) -> bool:
        if self.round is None or self.round.number != number:
            return False
        # A generator: stops at the first member not asking, so asking it as each of
        # thousands of members arrives costs about N log N in all, not N squared.
        workers = self.workers
        return all(m.asking_round == number for m in (workers[w] for w in self.round.members) if not m.state.finished)

    def report(self, report: Report) -> None:
        with self.cond:
            record = self._get(report.worker_id)
            self._note_ahead(record, round_number=report.round)
            record.report = report
            record.reported_at = self._clock()
            if report.snapshots_written or report.snapshots_failed:
                record.snapshots = (report.snapshots_written, report.snapshots_failed, report.snapshot_error[:200])
            self.reports += 1
            if report.outcome == Outcome.DONE and self.current_member(record):
                number = self.round.number  # type: ignore[union-attr]
                if self._returned_in == number:
                    # Training had already returned in this round: the driver decides again
                    # when this worker exits (its reap wakes it), not now. At the end of a
                    # job of thousands, a decision pass per DONE, each under this lock,
                    # took seconds while the reports queued behind them.
                    return
                self._returned_in = number
            self.note_change()


def outcome_of(record: WorkerRecord) -> Outcome | None:
    return record.report.outcome if record.report else None


def normalize_error(text: str) -> str:
    """An error message with its numbers masked: ports, addresses and times differ between rounds."""
    return re.sub(r"0x[0-9a-fA-F]+|[0-9]+", "#", text).strip()


def repeated_collective_error(breaks: Sequence[RoundBreak], limit: int) -> str | None:
    """The job-ending message when the last ``limit`` rounds all ended with the same
    collective error, among the same members, without a single commit; else None.

    A lost peer ends a round too, but costs a host (it is blacklisted), so it cannot repeat
    without bound; a collective error without an exit can. ``limit`` 0 turns this off.
    """
    if limit <= 0 or len(breaks) < limit:
        return None
    last = breaks[-limit:]
    first = last[0]
    key = normalize_error(first.error)
    for previous, current in zip(last, last[1:]):
        if current.round != previous.round + 1:
            return None
    if not first.error or any(
        not b.error or normalize_error(b.error) != key or b.slots != first.slots or b.commits for b in last
    ):
        return None
    return (
        f"the same collective error ended {limit} consecutive rounds ({first.round}-{last[-1].round}) "
        f"with no commit in between: {last[-1].error}"
    )


@dataclasses.dataclass(frozen=True)
class ErrorView:
    """What the driver knows when a member asks about an error it caught in its round."""

    broken: bool  # the round lost a member: one exited, was killed, left, or had a collective error
    judged_own: bool  # every live member once asked at the same time: the same error everywhere
    all_members_asking: bool  # every live member of the round is asking now
    collective: bool  # the asker's error is a collective failure by its type
    repeated_error: str | None  # the same collective error ended too many rounds
    waited_out: bool  # the asker's bounded wait is over
    # A member of the round was told its error is its own, the same error as the asker's
    # (numbers aside): the asker raised it too, only later.
    failed_alike: bool = False
    # ... a different error: that member is leaving the round, which is lost to the asker.
    failed_other: bool = False
    # Every other live member sent a request after the asker's question: none was lost
    # when the asker raised.
    others_alive: bool = False


def classify_error(view: ErrorView) -> RoundLostReply | None:
    """The answer to a member's error, or None to wait for more facts.

    "Lost" (recover from the last commit) when the round is broken, or a member of it was
    told its own, different, error is its own (it is leaving); a collective error broke the
    round itself, so it is recovered from unless it keeps repeating. "Own error" when every
    live member asks (the same error everywhere: the user's), when a member already failed
    with the same error (the same, raised a little later), when every other member showed
    it is alive after the question (no peer was lost: peers that raise the same error later
    are caught by the previous rule), else after the wait.
    """
    if view.collective:
        if view.repeated_error is not None:
            return RoundLostReply(False, view.repeated_error)
        return RoundLostReply(True)
    if view.judged_own or view.failed_alike:
        return RoundLostReply(False)
    if view.broken or view.failed_other:
        return RoundLostReply(True)
    if view.all_members_asking or view.others_alive or view.waited_out:
        return RoundLostReply(False)
    return None


@dataclasses.dataclass
class CheckIn:
    """An asker's call-in: the other members of ``round`` show they are alive after ``since``."""

    asker: str
    round: int
    since: float
    cursor: int = 0  # members before it (in rank order) are shown alive or finished
