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
import logging
import threading
import time
from collections.abc import Callable

from lightning_elastic.launcher.config import MAX_LOST_MEMBER_WAIT, MAX_VERDICT_WAIT
from lightning_elastic.launcher.job import rounds
from lightning_elastic.launcher.job.collective_errors import (
    MAX_ERROR_CHARS,
    ErrorView,
    classify_error,
    normalize_error,
)
from lightning_elastic.launcher.job.effects import Changed, Effects, Log, Wake, WakeLive
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.job.state import (
    ROUNDS_KEPT,
    CheckIn,
    JobState,
    RoundInfo,
    WorkerRecord,
    WorkerState,
)
from lightning_elastic.launcher.service.long_poll import LongPoll, Signal
from lightning_elastic.protocol import (
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
    clip,
)


log = logging.getLogger("lightning_elastic.driver")



class UnknownWorker(LookupError):
    """A request from a worker the registry does not count. ``ended``: one it counted until
    it finished (a heartbeat sent just before its exit, answered after it was reaped), not a
    stranger: answered the same, but no rejection of note."""

    def __init__(self, message: str, ended: bool = False) -> None:
        super().__init__(message)
        self.ended = ended


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic, repeated_error_limit: int = 3,
                 state: JobState | None = None) -> None:
        self._clock = clock
        self._repeated_error_limit = repeated_error_limit
        self.state = state if state is not None else JobState()
        if repeated_error_limit > ROUNDS_KEPT:
            self.state.breaks = collections.deque(self.state.breaks, maxlen=repeated_error_limit)
        # One lock for the driver loop and every request. ``cond`` is the driver loop's, woken
        # by what the driver acts on; requests wait on their worker's own signal.
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)
        # Bumped whenever the driver is notified of a request: the driver re-plans only
        # when it moved (or a timer is due), not on every tick.
        self.changes = 0
        # Bumped by every report, noted or not: a report that needs no decision (see
        # ``report``) still belongs in the state a --state-dir driver saves.
        self.reports = 0
        # The one asker whose round's other members are called in to show they are alive
        # (see round_lost_poll), and when the latest call-in began: a heartbeat parked
        # before then answers at once, so that its worker sends a fresh one.
        self._checking: CheckIn | None = None
        self._called_in_at = float("-inf")

    # ----- the core's transitions, with their in-memory effects performed at once -------
    # (call with self.cond held; the decision loop performs the same effects itself)

    def perform(self, fx: Effects) -> None:
        """Perform what a transition asked for that lives in memory: wakes, the loop's
        notification, log lines. Other effects (starts, signals) never come from the
        transitions the service runs."""
        for effect in fx:
            kind = type(effect)
            if kind is Wake:
                workers = self.state.workers
                for worker_id in effect.worker_ids:
                    record = workers.get(worker_id)
                    if record is not None and record.wake is not None:
                        record.wake.fire()
            elif kind is WakeLive:
                self._fire_live()
            elif kind is Changed:
                self.note_change()
            elif kind is Log:
                log.log(effect.level, effect.message, *effect.args)
            else:  # a bug: the service would drop what the core asked for
                raise TypeError(f"the service cannot perform {effect!r}")

    def add_worker(self, worker_id: str, slot: SlotKey) -> WorkerRecord:
        fx = Effects()
        record = rounds.add_worker(self.state, worker_id, slot, self._clock(), fx)
        record.wake = Signal()
        self.perform(fx)
        return record

    def bump_generation(self) -> int:
        fx = Effects()
        generation = rounds.bump_generation(self.state, fx)
        self.perform(fx)
        return generation

    def mark_round_broken(self, number: int, cause: str = "a member was lost", error: str = "", commits: int = 0) -> bool:
        fx = Effects()
        broken = rounds.mark_round_broken(self.state, number, cause, fx, error, commits, self._repeated_error_limit)
        self.perform(fx)
        return broken

    def form_round(self, members: list[tuple[WorkerRecord, SlotAssignment]], store: tuple[str, int]) -> RoundInfo:
        self.state.address, self.state.port = store
        fx = Effects()
        info = rounds.form_round(self.state, members, fx)
        self.perform(fx)
        return info

    def forget_finished(self, keep: set[str]) -> list[str]:
        return rounds.forget_finished(self.state, keep)

    def wake(self, record: WorkerRecord) -> None:
        """This worker's fate changed (told to leave, stopped, reaped): its pending requests
        must look again."""
        if record.wake is not None:
            record.wake.fire()

    def wake_all(self) -> None:
        """Wake every pending request and the driver loop (the driver is stopping)."""
        for record in self.state.workers.values():
            self.wake(record)
        self.cond.notify_all()

    def await_arrivals(self, *groups: set[str]) -> None:
        """Wake the driver on an arrival only once every worker of one of ``groups`` has
        arrived (the whole target world: a round to form; the joiners: a change to
        announce). At thousands of workers, a decision per arrival would cost the driver
        N decisions of O(N) each. No groups: wake it on every arrival."""
        self.state.awaited = [set(g) for g in groups if g] if groups else None

    def note_change(self) -> None:
        """Something the driver must decide on happened: wake its loop for a decision pass."""
        self.changes += 1
        self.cond.notify_all()

    def _fire_live(self) -> None:
        for record in self.state.workers.values():
            if not record.state.finished and record.wake is not None:
                record.wake.fire()

    def _fire_askers(self) -> None:
        for worker_id in self.state.asking:
            self.wake(self.state.workers[worker_id])

    def live_workers(self) -> list[WorkerRecord]:
        return self.state.live_workers()

    def current_member(self, record: WorkerRecord) -> bool:
        return self.state.current_member(record)

    # ----- service side: each call records, then waits (bounded) for the driver -------

    def _get(self, worker_id: str) -> WorkerRecord:
        record = self.state.workers.get(worker_id)
        if record is None or record.state.finished:
            raise UnknownWorker(f"unknown or finished worker {worker_id!r}", ended=record is not None)
        return record

    def _poll(self, answer, record: WorkerRecord, timeout: float, finish=lambda: None) -> LongPoll:
        if record.wake is None:  # its first request: its pending requests wait on this
            record.wake = Signal()
        return LongPoll(self._lock, answer, record.wake, self._clock() + timeout, self._clock, finish)

    def rendezvous(self, request: RendezvousRequest, timeout: float = RENDEZVOUS_POLL) -> RendezvousReply:
        return self.rendezvous_poll(request, timeout).wait()

    def rendezvous_poll(self, request: RendezvousRequest, timeout: float = RENDEZVOUS_POLL) -> LongPoll[RendezvousReply]:
        with self.cond:
            record = self._get(request.worker_id)
            self._note_ahead(record, round_number=request.after_round)
            now = self._clock()
            record.last_heartbeat = now
            if not self._assigned_after(record, request.after_round):
                self._arrive(record, request.after_round, now)
            # else: a repeat of the request that got this assignment (the client retries
            # when the reply is lost): answered again below, rather than turning a member
            # into a waiting worker that no round will ever pick up again.

        def answer(final: bool) -> RendezvousReply | None:
            # A round it is a member of comes first, even once it is told to leave: its peers
            # were given that round, with it at its rank (rank 0 when it holds the state they
            # wait for), and an EXIT would leave them waiting for it to form the round's group.
            # (A rolling move: the driver lets the holder go in its next pass after forming the
            # round with the joiner; a loaded service reads this answer after that pass.) It
            # leaves at the announcement that the removal brings, at its next rendezvous.
            if self._assigned_after(record, request.after_round):
                return RendezvousReply(RendezvousStatus.ASSIGNED, record.assignment)
            if record.leave:
                return RendezvousReply(RendezvousStatus.EXIT)
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
        if self.state.awaited is None:
            self.note_change()
            return
        for group in self.state.awaited:
            if record.worker_id in group:
                group.discard(record.worker_id)
                if not group:
                    self.note_change()  # the last arrival of a group the driver waited for

    def _note_left_round(self, record: WorkerRecord, after_round: int) -> None:
        """A member back at the rendezvous with no change announced has left its round.

        Its peers cannot complete a collective without it (say its own collective timed
        out): for them it is lost, exactly as if it had exited.
        """
        current = self.state.round
        if (
            current is not None
            and after_round == current.number
            and self.current_member(record)
            and self.state.generation == current.generation
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
        if self.state.reserved is None:  # not adopted: every round and generation is this registry's own
            return
        current = self.state.round.number if self.state.round is not None else 0
        if generation <= self.state.generation and round_number <= max(current, self.state.round_floor):
            return
        log.warning("Worker %s knows round %d / generation %d, newer than this driver's saved round %d / "
                    "generation %d: the previous driver died before saving them; the workers re-form.",
                    record.worker_id, round_number, generation, current, self.state.generation)
        self.state.round_floor = max(self.state.round_floor, current, round_number, self.state.reserved[0])
        self.state.generation = max(self.state.generation, generation, self.state.reserved[1])
        if self.state.round is not None:
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
                asker = self.state.workers.get(checking.asker)
                if asker is not None:
                    self.wake(asker)  # one more of its peers may have shown it is alive
            if request.snapshots_written or request.snapshots_failed:
                record.snapshots = (request.snapshots_written, request.snapshots_failed, clip(request.snapshot_error, 200))
            if request.stepped_round > 0:
                known = self.state.first_steps.get(request.stepped_round)
                if known is None or request.stepped_at < known:
                    self.state.first_steps[request.stepped_round] = request.stepped_at
                    self.note_change()  # for the timeline

        def answer(final: bool) -> HeartbeatReply | None:
            # Answer early on a broken round too: a member blocked in a collective on a dead
            # peer (NCCL often hangs rather than fails) learns it a long poll sooner.
            broken = max(self.state.broken_rounds, default=0)
            if (final or self.state.generation > request.known_generation or broken > request.known_broken_round
                    or arrived < self._called_in_at):  # called in: the next heartbeat shows it alive
                return HeartbeatReply(self.state.generation, broken)
            return None

        return self._poll(answer, record, min(request.wait_seconds, RENDEZVOUS_POLL))

    def round_lost(self, request: RoundLostRequest) -> RoundLostReply:
        """Did ``request.round`` lose a member? Answers early both ways (see ``classify_error``).

        A collective error first breaks the round (its member leaves it whatever the answer).
        """
        return self.round_lost_poll(request).wait()

    def round_lost_poll(self, request: RoundLostRequest) -> LongPoll[RoundLostReply]:
        wait = min(request.wait_seconds, MAX_LOST_MEMBER_WAIT)
        # The bound of the whole wait: --error-wait, or longer while a peer has been silent
        # since the question, for the driver's verdict on it (see classify_error).
        longest = max(wait, min(request.verdict_wait_seconds, MAX_VERDICT_WAIT))
        key = normalize_error(request.error[:MAX_ERROR_CHARS]) if request.error else ""
        with self.cond:
            record = self._get(request.worker_id)
            self._note_ahead(record, round_number=request.round)
            record.asking_round = request.round
            self.state.asking.add(record.worker_id)
            now = record.last_heartbeat = self._clock()
            waited_out_at, out_of_time_at = now + wait, now + longest
            # Who of the round has shown itself since the question (the call-in's scan when
            # this asker calls in; its own otherwise, read only once its --error-wait is over).
            shown = CheckIn(record.worker_id, request.round, now)
            if self._all_members_asking(request.round):
                self._fire_askers()  # the others' answer changed: the same error everywhere
            current = self.state.round.number if self.state.round is not None else 0
            if request.collective and request.round == current:
                self.mark_round_broken(
                    request.round,
                    f"worker {record.worker_id} left round {request.round} after a collective error: {request.error}",
                    error=request.error or "collective error",
                    commits=request.commits,
                )
            elif self._may_call_in(request.round):
                self._call_in(record, shown)

        def answer(final: bool) -> RoundLostReply | None:
            broken = request.round in self.state.broken_rounds
            at = self._clock()
            waited_out = final or at >= waited_out_at
            out_of_time = at >= out_of_time_at
            # O(members): not asked of a broken round, whose answer does not need it (at
            # thousands of members, every one asks about the same broken round at once).
            all_asking = not broken and self._all_members_asking(request.round)
            own = self.state.own_errors.get(request.round, ())
            alike = bool(key) and key in own
            checking = self._checking
            view = ErrorView(
                broken=broken,
                judged_own=request.round in self.state.user_error_rounds,
                all_members_asking=all_asking,
                collective=request.collective,
                repeated_error=self.state.repeated_error,
                waited_out=waited_out,
                failed_alike=alike,
                failed_other=bool(own) and not alike,
                others_alive=checking is shown and self._others_shown_alive(shown),
                # Read only when it decides: at most one scan of the members per asker.
                peer_silent=waited_out and not out_of_time and not broken and self._peer_silent(shown),
                out_of_time=out_of_time,
            )
            reply = classify_error(view)
            if reply is None and final:
                # --error-wait is over with a peer silent since the question: wait on for
                # the driver's verdict on it (a kill or exit breaks the round and wakes this).
                poll.deadline = out_of_time_at
            if reply is not None and all_asking and not reply.lost and not request.collective:
                # Sticky, so members answered later agree.
                self.state.user_error_rounds.add(request.round)
                self._fire_askers()
            if reply is not None and not reply.lost and not request.collective:
                # It leaves the round now: other askers' answers changed (see _own_errors).
                self.state.own_errors.setdefault(request.round, set()).add(key)
                self._fire_askers()
            return reply

        def finish() -> None:
            record.asking_round = None
            self.state.asking.discard(record.worker_id)
            if self._checking is not None and self._checking.asker == record.worker_id:
                self._checking = None

        poll = self._poll(answer, record, wait, finish)
        return poll

    def leave(self, request: LeaveRequest) -> LeaveReply:
        """A worker got a preemption notice: let it leave at its next check, or not."""
        with self.cond:
            record = self._get(request.worker_id)
            if self.state.closing or record.stopping or record.reported_done:
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
        return (self._checking is None and self.state.round is not None and self.state.round.number == number
                and number not in self.state.broken_rounds and number not in self.state.own_errors)

    def _call_in(self, record: WorkerRecord, checking: CheckIn) -> None:
        """Ask every other live member of round ``checking.round`` for a heartbeat now: one
        that sends it after ``record``'s question was alive after its error, so that error
        is not a consequence of that member's loss."""
        self._checking = checking
        self._called_in_at = checking.since
        assert self.state.round is not None
        for worker_id in self.state.round.members:
            member = self.state.workers.get(worker_id)
            if member is not None and member is not record and not member.state.finished:
                self.wake(member)

    def _others_shown_alive(self, checking: CheckIn) -> bool:
        """Has every other live member of the checked round sent a request since the
        question? Members stay shown alive, so the scan resumes where it stopped: O(members)
        for the whole wait, however many heartbeats wake it."""
        if self.state.round is None or self.state.round.number != checking.round:
            return False
        members = self.state.round.members
        while checking.cursor < len(members):
            member = self.state.workers.get(members[checking.cursor])
            if not (member is None or member.state.finished or member.worker_id == checking.asker
                    or (member.last_heartbeat is not None and member.last_heartbeat > checking.since)):
                return False
            checking.cursor += 1
        return True

    def _peer_silent(self, shown: CheckIn) -> bool:
        """Has a live member of the current round (``shown.round``) sent nothing since the
        question? Not said of an older round: its members are not known any more."""
        current = self.state.round
        return current is not None and current.number == shown.round and not self._others_shown_alive(shown)

    def _all_members_asking(self, number: int) -> bool:
        if self.state.round is None or self.state.round.number != number:
            return False
        # A generator: stops at the first member not asking, so asking it as each of
        # thousands of members arrives costs about N log N in all, not N squared.
        workers = self.state.workers
        return all(m.asking_round == number for m in (workers[w] for w in self.state.round.members) if not m.state.finished)

    def report(self, report: Report) -> None:
        with self.cond:
            record = self._get(report.worker_id)
            self._note_ahead(record, round_number=report.round)
            record.report = report
            record.reported_at = self._clock()
            if report.snapshots_written or report.snapshots_failed:
                record.snapshots = (report.snapshots_written, report.snapshots_failed, clip(report.snapshot_error, 200))
            self.reports += 1
            if report.outcome == Outcome.DONE and self.current_member(record):
                number = self.state.round.number  # type: ignore[union-attr]
                if self.state.returned_in == number:
                    # Training had already returned in this round: the driver decides again
                    # when this worker exits (its reap wakes it), not now. At the end of a
                    # job of thousands, a decision pass per DONE, each under this lock,
                    # took seconds while the reports queued behind them.
                    return
                self.state.returned_in = number
            self.note_change()


def outcome_of(record: WorkerRecord) -> Outcome | None:
    return record.report.outcome if record.report else None
