"""The transitions of the job's rounds, shared by the decision loop and the rendezvous service.

Each changes the ``JobState`` and appends what must follow to ``fx`` (see
``job/effects.py``): whose pending requests must look again, and that the loop must decide
again. The caller performs those at once, under the job's lock.

Invariants kept here:
- round numbers and generations only grow (past what a predecessor may have reserved);
- a round is broken at most once, and a break is recorded with the members it had;
- per-round facts (breaks, user-error rounds, first steps, own errors) stay bounded.
"""

from __future__ import annotations

from lightning_elastic.launcher.job.collective_errors import repeated_collective_error
from lightning_elastic.launcher.job.effects import Effects
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.job.state import ROUNDS_KEPT, JobState, RoundBreak, RoundInfo, WorkerRecord, WorkerState
from lightning_elastic.protocol import Assignment


def add_worker(state: JobState, worker_id: str, slot: SlotKey, now: float, fx: Effects) -> WorkerRecord:
    record = WorkerRecord(worker_id, slot, started_at=now)
    state.workers[worker_id] = record
    fx.changed()
    return record


def bump_generation(state: JobState, fx: Effects) -> int:
    """Tell every member to re-form at its next check of host updates."""
    state.generation += 1
    fx.changed()
    fx.wake_live()  # every heartbeat long poll answers at once
    return state.generation


def mark_round_broken(state: JobState, number: int, cause: str, fx: Effects, error: str = "", commits: int = 0,
                      repeated_error_limit: int = 3) -> bool:
    """Record that round ``number`` lost a member; False if it was already broken."""
    if number in state.broken_rounds:
        return False
    state.broken_rounds.add(number)
    slots = state.round.slots if state.round is not None and state.round.number == number else ()
    state.breaks.append(RoundBreak(number, slots, cause, error, commits))
    fx.info("Round %d is broken: %s.", number, cause)
    if state.repeated_error is None:
        state.repeated_error = repeated_collective_error(list(state.breaks), repeated_error_limit)
    fx.changed()
    fx.wake_live()  # heartbeats and round-lost verdicts answer at once
    return True


def form_round(state: JobState, members: list[tuple[WorkerRecord, SlotAssignment]], fx: Effects) -> RoundInfo:
    """Make ``members`` (in rank order) the next round; the store is the driver's own service."""
    number = max(state.round.number if state.round else 0, state.round_floor) + 1
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
            store_host=state.address,
            store_port=state.port,
            generation=state.generation,
        )
        record.state = WorkerState.MEMBER
        record.arrived_after_round = None
        record.waiting_since = None
    state.round = RoundInfo(number, tuple(r.worker_id for r, _ in members), state.generation,
                            tuple(r.slot for r, _ in members))
    for old in [r for r in state.own_errors if r < number - 1]:
        del state.own_errors[old]
    _forget_rounds_before(state, number - ROUNDS_KEPT)
    fx.changed()
    fx.wake(*(r.worker_id for r, _ in members))
    if state.asking:  # asking about the previous round: "all members asking" changed
        fx.wake(*state.asking)
    return state.round


def forget_finished(state: JobState, keep: set[str]) -> list[str]:
    """Drop the records of finished workers outside ``keep`` (the round just formed) and
    return their ids. A job replacing workers for weeks would otherwise hold, and scan on
    every pass, every worker it ever started. A request still in flight from one (it
    exited) is then refused as from an unknown worker."""
    gone = [w for w, record in state.workers.items() if record.state.finished and w not in keep]
    for worker_id in gone:
        del state.workers[worker_id]
        state.asking.discard(worker_id)
    return gone


def _forget_rounds_before(state: JobState, oldest: int) -> None:
    """Per-round facts stay bounded over a job of weeks (``breaks`` is a bounded deque)."""
    state.broken_rounds = {n for n in state.broken_rounds if n >= oldest}
    state.user_error_rounds = {n for n in state.user_error_rounds if n >= oldest}
    for n in [n for n in state.first_steps if n < oldest]:
        del state.first_steps[n]
