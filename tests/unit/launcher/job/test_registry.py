"""launcher/service/registry.py: what the rendezvous service records and answers.

Calls that may block run in a worker thread; the test waits for the registry's own
condition (``cond.wait_for`` with a deadline) instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.job.collective_errors import ErrorView, classify_error
from lightning_elastic.launcher.job.state import CheckIn, WorkerRecord, WorkerState
from lightning_elastic.launcher.service.registry import Registry, UnknownWorker, outcome_of
from lightning_elastic.protocol import (
    HeartbeatRequest,
    LeaveReply,
    LeaveRequest,
    RoundLostReply,
    Outcome,
    RendezvousRequest,
    RendezvousStatus,
    Report,
    RoundLostRequest,
)

pytestmark = pytest.mark.timeout(30)

STORE = ("127.0.0.1", 29500)
PROMPT = 5.0  # an answer that should be immediate must come within this (generous on a loaded CI box)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reg() -> Registry:
    return Registry()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as ex:
        yield ex


def add(reg: Registry, worker_id: str, host: str = "a", local_rank: int = 0) -> WorkerRecord:
    with reg.cond:
        return reg.add_worker(worker_id, SlotKey(host, local_rank))


def form(reg: Registry, *records: WorkerRecord):
    n = len(records)
    members = [
        (r, SlotAssignment(r.slot, rank=i, size=n, local_size=1, cross_rank=i, cross_size=n))
        for i, r in enumerate(records)
    ]
    with reg.cond:
        return reg.form_round(members, STORE)


def wait_until(reg: Registry, predicate: Callable[[], bool], timeout: float = PROMPT) -> None:
    with reg.cond:
        assert reg.cond.wait_for(predicate, timeout), "condition not reached in time"


def finish(reg: Registry, record: WorkerRecord, state: WorkerState) -> None:
    with reg.cond:
        record.state = state
        reg.wake_all()


# ----- driver side ---------------------------------------------------------------------


def test_new_worker_is_starting_and_live(reg):
    w = add(reg, "w0")
    assert w.state == WorkerState.STARTING
    assert reg.live_workers() == [w]
    assert w.rank is None


@pytest.mark.parametrize("state", [WorkerState.DONE, WorkerState.REMOVED, WorkerState.FAILED])
def test_finished_workers_are_not_live(reg, state):
    w = add(reg, "w0")
    add(reg, "w1")
    finish(reg, w, state)
    assert [r.worker_id for r in reg.live_workers()] == ["w1"]


def test_finished_workers_outside_the_new_round_are_forgotten(reg):
    a, b, c, d = (add(reg, f"w{i}", f"h{i}") for i in range(4))
    form(reg, a, b, c)
    finish(reg, b, WorkerState.FAILED)  # lost, and a member of the round just formed
    finish(reg, d, WorkerState.FAILED)  # failed before it ever joined
    with reg.cond:
        assert reg.forget_finished({"w1"}) == ["w3"]  # a member of the new round stays
        assert sorted(reg.state.workers) == ["w0", "w1", "w2"]
        assert reg.forget_finished({"w0", "w2"}) == ["w1"]
    assert [r.worker_id for r in reg.live_workers()] == ["w0", "w2"]
    with pytest.raises(UnknownWorker):  # a late request from a forgotten worker: refused
        reg.heartbeat(HeartbeatRequest("w3", 0, 0, 0.0))


def test_form_round_assigns_every_member(reg):
    a, b = add(reg, "w0", "h1"), add(reg, "w1", "h2")
    with reg.cond:
        reg.bump_generation()
    info = form(reg, a, b)
    assert info.number == 1 and info.members == ("w0", "w1") and info.generation == 1
    assert (a.state, b.state) == (WorkerState.MEMBER, WorkerState.MEMBER)
    assert (a.rank, b.rank) == (0, 1)
    assert b.assignment.round == 1 and b.assignment.size == 2 and b.assignment.hostname == "h2"
    assert (b.assignment.store_host, b.assignment.store_port) == STORE
    assert b.assignment.generation == 1


def test_round_numbers_increase(reg):
    a = add(reg, "w0")
    assert form(reg, a).number == 1
    assert form(reg, a).number == 2
    assert a.assignment.round == 2


def test_bump_generation_counts_up(reg):
    with reg.cond:
        assert [reg.bump_generation() for _ in range(3)] == [1, 2, 3]


# ----- rendezvous ----------------------------------------------------------------------


def test_rendezvous_of_unknown_worker_is_refused(reg):
    with pytest.raises(UnknownWorker, match="'nobody'"):
        reg.rendezvous(RendezvousRequest("nobody", 0), timeout=0)


@pytest.mark.parametrize("state", [WorkerState.DONE, WorkerState.REMOVED, WorkerState.FAILED])
def test_rendezvous_of_finished_worker_is_refused(reg, state):
    w = add(reg, "w0")
    finish(reg, w, state)
    with pytest.raises(UnknownWorker):
        reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)


def test_rendezvous_without_a_round_answers_wait_and_records_arrival():
    clock = FakeClock(50.0)
    reg = Registry(clock)
    w = add(reg, "w0")
    reply = reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    assert reply.status == RendezvousStatus.WAIT and reply.assignment is None
    assert w.state == WorkerState.WAITING
    assert w.arrived_after_round == 0
    assert w.last_heartbeat == 50.0 and w.waiting_since == 50.0


def test_a_hot_spare_is_told_so_while_it_waits():
    reg = Registry(FakeClock(50.0))
    add(reg, "w0").standby = True
    reply = reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    assert reply.status == RendezvousStatus.WAIT and reply.standby


def test_repeated_rendezvous_keeps_waiting_since_but_refreshes_heartbeat():
    clock = FakeClock(50.0)
    reg = Registry(clock)
    w = add(reg, "w0")
    reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    clock.now = 55.0
    reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    assert w.waiting_since == 50.0 and w.last_heartbeat == 55.0


def test_waiting_rendezvous_is_answered_when_the_round_forms(reg, pool):
    w = add(reg, "w0", "h")
    fut: Future = pool.submit(reg.rendezvous, RendezvousRequest("w0", 0), 30.0)
    wait_until(reg, lambda: w.state == WorkerState.WAITING)
    form(reg, w)
    reply = fut.result(timeout=PROMPT)
    assert reply.status == RendezvousStatus.ASSIGNED
    assert reply.assignment == w.assignment
    assert (reply.assignment.round, reply.assignment.rank, reply.assignment.size) == (1, 0, 1)


def test_member_coming_back_after_its_round_waits_for_the_next(reg):
    w = add(reg, "w0")
    form(reg, w)
    reply = reg.rendezvous(RendezvousRequest("w0", 1), timeout=0)
    assert reply.status == RendezvousStatus.WAIT
    assert w.state == WorkerState.WAITING and w.arrived_after_round == 1


def test_leaving_worker_is_told_to_exit(reg):
    w = add(reg, "w0")
    form(reg, w)
    w.leave = True
    reply = reg.rendezvous(RendezvousRequest("w0", 1), timeout=30.0)
    assert reply.status == RendezvousStatus.EXIT
    assert w.state == WorkerState.MEMBER  # not turned into a waiting worker


def test_waiting_worker_is_told_to_exit_once_it_must_leave(reg, pool):
    w = add(reg, "w0")
    fut = pool.submit(reg.rendezvous, RendezvousRequest("w0", 0), 30.0)
    wait_until(reg, lambda: w.state == WorkerState.WAITING)
    with reg.cond:
        w.leave = True
        reg.wake(w)
    assert fut.result(timeout=PROMPT).status == RendezvousStatus.EXIT


def test_a_member_told_to_leave_before_it_heard_of_its_round_is_given_the_round(reg, pool):
    # The driver forms a round with the waiting worker, then (its next pass, before the
    # service has answered the worker's pending request) tells it to leave. Its peers were
    # given that round with it in it: it must take part, or they wait in vain for it in the
    # round's first collective. It leaves at its next rendezvous.
    holder, joiner = add(reg, "holder", "h2"), add(reg, "joiner", "h3")
    with reg.cond:
        reg.await_arrivals()
    pending: Future = pool.submit(reg.rendezvous, RendezvousRequest("holder", 0), 30.0)
    wait_until(reg, lambda: holder.state == WorkerState.WAITING)
    with reg.cond:  # one hold of the lock: the service's thread cannot answer in between
        form(reg, holder, joiner)
        holder.leave = True
        reg.wake(holder)
    reply = pending.result(timeout=PROMPT)
    assert reply.status == RendezvousStatus.ASSIGNED and reply.assignment == holder.assignment
    # A repeat of that request (its reply lost) gets the same round, not EXIT.
    again = reg.rendezvous(RendezvousRequest("holder", 0), timeout=0)
    assert again.status == RendezvousStatus.ASSIGNED and again.assignment.round == 1
    assert holder.state == WorkerState.MEMBER
    assert reg.rendezvous(RendezvousRequest("holder", 1), timeout=30.0).status == RendezvousStatus.EXIT
    assert reg.state.broken_rounds == set()


def test_the_driver_wakes_only_for_the_last_arrival_it_awaits(reg):
    workers = [add(reg, f"w{i}", local_rank=i) for i in range(3)]
    with reg.cond:
        reg.await_arrivals({"w0", "w1"})
        before = reg.changes
    reg.rendezvous(RendezvousRequest("w2", 0), timeout=0)  # not awaited
    reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    assert reg.changes == before  # nothing to decide yet
    reg.rendezvous(RendezvousRequest("w1", 0), timeout=0)
    assert reg.changes == before + 1
    assert all(w.state == WorkerState.WAITING for w in workers)


def test_the_driver_wakes_when_either_awaited_group_has_arrived(reg):
    # The whole target world (a round to form) and its joiners (a change to announce).
    for i, worker_id in enumerate(("member", "joiner")):
        add(reg, worker_id, local_rank=i)
    with reg.cond:
        reg.await_arrivals({"member", "joiner"}, {"joiner"})
        before = reg.changes
    reg.rendezvous(RendezvousRequest("joiner", 0), timeout=0)
    assert reg.changes == before + 1  # every joiner waits: the driver may announce
    reg.rendezvous(RendezvousRequest("member", 0), timeout=0)
    assert reg.changes == before + 2  # the whole world waits: the driver may form a round


def test_without_awaited_arrivals_every_arrival_wakes_the_driver(reg):
    add(reg, "w0")
    add(reg, "w1", local_rank=1)
    before = reg.changes
    reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    reg.rendezvous(RendezvousRequest("w1", 0), timeout=0)
    assert reg.changes == before + 2


def test_telling_one_worker_to_leave_wakes_only_its_requests(reg):
    a, b = add(reg, "a"), add(reg, "b", local_rank=1)
    woken: list[str] = []
    with reg.cond:
        a.wake.subscribe(lambda: woken.append("a"))
        b.wake.subscribe(lambda: woken.append("b"))
        a.leave = True
        reg.wake(a)
    assert woken == ["a"]


def test_a_broken_round_and_a_generation_bump_wake_every_live_worker(reg):
    a, b, gone = add(reg, "a"), add(reg, "b", local_rank=1), add(reg, "gone", local_rank=2)
    form(reg, a, b)
    gone.state = WorkerState.FAILED
    woken: list[str] = []
    with reg.cond:
        for w in (a, b, gone):
            w.wake.subscribe(lambda w=w: woken.append(w.worker_id))
        reg.mark_round_broken(1)
    assert sorted(woken) == ["a", "b"]
    woken.clear()
    with reg.cond:
        for w in (a, b):
            w.wake.subscribe(lambda w=w: woken.append(w.worker_id))
        reg.bump_generation()
    assert sorted(woken) == ["a", "b"]


def test_repeated_rendezvous_of_an_assigned_worker_gets_its_assignment_again(reg):
    # The worker asked after round 0, was assigned round 1, but never saw the reply and asks
    # again (DriverClient retries on connection errors). The assignment is still newer than
    # what it knows, and the code checks exactly that (a.round > after_round).
    w = add(reg, "w0")
    form(reg, w)
    reply = reg.rendezvous(RendezvousRequest("w0", 0), timeout=0)
    assert reply.status == RendezvousStatus.ASSIGNED
    assert reply.assignment is not None and reply.assignment.round == 1
    assert w.state == WorkerState.MEMBER


# ----- heartbeat -----------------------------------------------------------------------


def test_heartbeat_answers_at_once_when_generation_is_newer(reg):
    w = add(reg, "w0")
    with reg.cond:
        reg.bump_generation()
        reg.bump_generation()
    reply = reg.heartbeat(HeartbeatRequest("w0", known_generation=0, known_broken_round=0, wait_seconds=30.0))
    assert (reply.generation, reply.last_broken_round) == (2, 0)
    assert w.last_heartbeat is not None


def test_heartbeat_with_no_wait_answers_current_generation(reg):
    add(reg, "w0")
    reply = reg.heartbeat(HeartbeatRequest("w0", known_generation=0, known_broken_round=0, wait_seconds=0.0))
    assert reply.generation == 0


def test_heartbeat_long_poll_wakes_on_generation_bump(reg, pool):
    w = add(reg, "w0")
    fut = pool.submit(reg.heartbeat, HeartbeatRequest("w0", known_generation=0, known_broken_round=0, wait_seconds=30.0))
    wait_until(reg, lambda: w.last_heartbeat is not None)
    with reg.cond:
        reg.bump_generation()
    assert fut.result(timeout=PROMPT).generation == 1


def test_heartbeat_reports_highest_broken_round(reg):
    add(reg, "w0")
    with reg.cond:
        reg.mark_round_broken(3)
        reg.mark_round_broken(1)
    assert reg.heartbeat(HeartbeatRequest("w0", 0, 0, 0.0)).last_broken_round == 3


@pytest.fixture
def frozen(pool) -> Iterator[tuple[Registry, FakeClock]]:
    """A registry whose clock stands still: its long polls end only by waking, never by timing out.

    Depends on ``pool`` so it is torn down first, freeing a poll that failed to wake.
    """
    clock = FakeClock()
    reg = Registry(clock)
    yield reg, clock
    with reg.cond:  # let a poll that failed to wake end, so the pool can shut down
        clock.now += 3600
        reg.wake_all()


def test_heartbeat_answers_at_once_when_a_round_broke_after_the_known_one(frozen, pool):
    reg, _ = frozen
    add(reg, "w0")
    with reg.cond:
        reg.mark_round_broken(2)
    fut = pool.submit(reg.heartbeat, HeartbeatRequest("w0", known_generation=0, known_broken_round=1, wait_seconds=30.0))
    reply = fut.result(timeout=PROMPT)
    assert (reply.generation, reply.last_broken_round) == (0, 2)


def test_heartbeat_long_poll_wakes_when_a_round_breaks(frozen, pool):
    reg, _ = frozen
    w = add(reg, "w0")
    with reg.cond:
        reg.mark_round_broken(3)
    fut = pool.submit(reg.heartbeat, HeartbeatRequest("w0", known_generation=0, known_broken_round=3, wait_seconds=30.0))
    # Once the heartbeat is recorded, the poll has checked the broken round it already
    # knows (3) under the lock; answering then would report 3, not the 4 marked below.
    wait_until(reg, lambda: w.last_heartbeat is not None)
    with reg.cond:
        reg.mark_round_broken(4)
    reply = fut.result(timeout=PROMPT)
    assert (reply.generation, reply.last_broken_round) == (0, 4)


def test_heartbeat_of_unknown_or_finished_worker_is_refused(reg):
    w = add(reg, "w0")
    with pytest.raises(UnknownWorker):
        reg.heartbeat(HeartbeatRequest("other", 0, 0, 0.0))
    finish(reg, w, WorkerState.FAILED)
    with pytest.raises(UnknownWorker):
        reg.heartbeat(HeartbeatRequest("w0", 0, 0, 0.0))


# ----- round_lost ----------------------------------------------------------------------


def test_round_lost_is_yes_at_once_for_a_broken_round(reg):
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    with reg.cond:
        reg.mark_round_broken(1)
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=30.0)).lost is True
    assert a.asking_round is None


def test_round_lost_is_no_after_the_wait_when_only_some_members_ask(reg):
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=0.05)).lost is False
    assert 1 not in reg.state.user_error_rounds  # one member's own error, not everyone's
    assert a.asking_round is None


def test_round_lost_wakes_with_yes_when_the_round_breaks(reg, pool):
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    fut = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, wait_seconds=30.0))
    wait_until(reg, lambda: a.asking_round == 1)
    with reg.cond:
        b.state = WorkerState.FAILED
        reg.mark_round_broken(1)
    assert fut.result(timeout=PROMPT).lost is True


def test_round_lost_is_user_error_only_when_every_live_member_asks(reg, pool):
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    first = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, wait_seconds=30.0))
    wait_until(reg, lambda: a.asking_round == 1)
    assert 1 not in reg.state.user_error_rounds
    # The last member asks: everyone hit the same error, so it is the user's; both answered now.
    assert reg.round_lost(RoundLostRequest("w1", 1, wait_seconds=30.0)).lost is False
    assert first.result(timeout=PROMPT).lost is False
    assert 1 in reg.state.user_error_rounds


def test_user_error_round_stays_user_error_for_later_askers(reg):
    a = add(reg, "w0")
    form(reg, a)
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=30.0)).lost is False
    with reg.cond:
        reg.mark_round_broken(1)
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=30.0)).lost is False


def test_finished_members_do_not_count_as_askers(reg):
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    finish(reg, b, WorkerState.REMOVED)
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=30.0)).lost is False
    assert 1 in reg.state.user_error_rounds


def test_asking_about_an_old_round_is_never_a_user_error(reg):
    a = add(reg, "w0")
    form(reg, a)
    form(reg, a)  # round 2 is current
    assert reg.round_lost(RoundLostRequest("w0", 1, wait_seconds=0.05)).lost is False
    assert 1 not in reg.state.user_error_rounds


def test_one_ranks_error_is_its_own_once_every_peer_shows_it_is_alive(reg, pool):
    # The peer waits for the asker in a collective; only its heartbeat thread runs. Its
    # parked heartbeat is answered at once (called in), and the next one it sends proves
    # it alive after the question: the error is the asker's own, long before the wait.
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    parked = pool.submit(reg.heartbeat, HeartbeatRequest("w1", 0, 0, 30.0))
    wait_until(reg, lambda: b.wake.waiting)
    asked = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 30.0, error="ValueError: bad batch 5"))
    assert parked.result(timeout=PROMPT).last_broken_round == 0
    assert not asked.done()  # alive before the question proves nothing
    pool.submit(reg.heartbeat, HeartbeatRequest("w1", 0, 0, 30.0))
    assert asked.result(timeout=PROMPT).lost is False
    assert 1 not in reg.state.user_error_rounds  # its own, not everyone's


def test_after_an_own_error_the_same_error_is_own_and_another_is_a_lost_peer(reg, pool):
    a, b, c = add(reg, "w0"), add(reg, "w1"), add(reg, "w2")
    form(reg, a, b, c)
    asked = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 30.0, error="ValueError: bad batch 5 on rank 0"))
    wait_until(reg, lambda: a.asking_round == 1)
    reg.heartbeat(HeartbeatRequest("w1", 0, 0, 0.0))
    reg.heartbeat(HeartbeatRequest("w2", 0, 0, 0.0))
    assert asked.result(timeout=PROMPT).lost is False
    # Before w0 is even reaped: a rank that raised the same error (numbers aside) a little
    # later has it too; one whose collective failed as w0 left recovers.
    same = reg.round_lost(RoundLostRequest("w1", 1, 30.0, error="ValueError: bad batch 5 on rank 1"))
    assert same.lost is False
    other = reg.round_lost(RoundLostRequest("w2", 1, 30.0, error="RuntimeError: Connection closed by peer"))
    assert other.lost is True
    # Once w0's exit broke the round, the same error is still everyone's.
    with reg.cond:
        a.state = WorkerState.FAILED
        reg.mark_round_broken(1, "worker w0 exited")
    assert reg.round_lost(RoundLostRequest("w1", 1, 30.0, error="ValueError: bad batch 7 on rank 1")).lost is False


def test_a_peer_that_never_shows_alive_keeps_the_wait_as_the_bound(reg, pool):
    # SIGKILLed and not reaped yet (or behind a partition): no heartbeat comes, so the
    # answer waits for the round to break, or for the wait.
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    reg.heartbeat(HeartbeatRequest("w1", 0, 0, 0.0))  # alive before the question only
    asked = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 30.0, error="RuntimeError: Connection reset"))
    wait_until(reg, lambda: a.asking_round == 1)
    with reg.cond:
        assert not reg.cond.wait_for(asked.done, 0.2)
        b.state = WorkerState.FAILED
        reg.mark_round_broken(1)
    assert asked.result(timeout=PROMPT).lost is True
    b2, c2 = add(reg, "w2"), add(reg, "w3")
    form(reg, b2, c2)
    assert reg.round_lost(RoundLostRequest("w2", 2, 0.05, error="ValueError: x")).lost is False


def test_a_peer_silent_since_the_question_holds_the_answer_past_the_error_wait_until_its_verdict(reg, pool):
    # Row 66: a node crashed with its worker; the driver sees no exit (srun lingers), only
    # the silence, and its heartbeat timeout breaks the round. The survivors' gloo errors
    # must wait for that, not be judged their own when --error-wait runs out.
    a, b, c = add(reg, "w0"), add(reg, "w1"), add(reg, "w2")
    form(reg, a, b, c)
    reg.heartbeat(HeartbeatRequest("w2", 0, 0, 0.0))  # w2: alive before the crash only
    asked = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 0.05, error="RuntimeError: Connection reset by peer",
                                                         verdict_wait_seconds=30.0))
    wait_until(reg, lambda: a.asking_round == 1)
    reg.heartbeat(HeartbeatRequest("w1", 0, 0, 0.0))  # the other survivor shows itself
    with reg.cond:
        assert not reg.cond.wait_for(asked.done, 0.3)  # past --error-wait (0.05 s): still waiting
        c.state = WorkerState.FAILED  # the driver's verdict: killed as silent
        reg.mark_round_broken(1, "worker w2 sent no heartbeat")
    assert asked.result(timeout=PROMPT).lost is True


def test_a_silent_peer_holds_the_answer_of_an_asker_that_did_not_call_in_too(reg, pool):
    a, b, c = add(reg, "w0"), add(reg, "w1"), add(reg, "w2")
    form(reg, a, b, c)
    first = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 0.05, error="RuntimeError: reset",
                                                         verdict_wait_seconds=30.0))
    wait_until(reg, lambda: a.asking_round == 1)
    second = pool.submit(reg.round_lost, RoundLostRequest("w1", 1, 0.05, error="RuntimeError: reset",
                                                          verdict_wait_seconds=30.0))
    wait_until(reg, lambda: b.asking_round == 1)
    with reg.cond:
        assert not reg.cond.wait_for(lambda: first.done() or second.done(), 0.3)
        c.state = WorkerState.FAILED
        reg.mark_round_broken(1, "worker w2 sent no heartbeat")
    assert first.result(timeout=PROMPT).lost is True
    assert second.result(timeout=PROMPT).lost is True


def test_a_silent_peer_never_judged_still_ends_the_wait_with_the_askers_own_error(reg):
    # Alive but never answering, or never judged (the driver was away): bounded all the same.
    a, b = add(reg, "w0"), add(reg, "w1")
    form(reg, a, b)
    reply = reg.round_lost(RoundLostRequest("w0", 1, 0.05, error="ValueError: x", verdict_wait_seconds=0.3))
    assert reply.lost is False
    with reg.cond:
        assert reg._checking is None and a.asking_round is None


def test_with_every_peer_shown_alive_the_error_wait_ends_the_wait_as_before(reg, pool):
    # An asker that did not call in (another asker's call-in was under way) and whose
    # peers all showed themselves since its question: its own error at --error-wait.
    a, b, c = add(reg, "w0"), add(reg, "w1"), add(reg, "w2")
    form(reg, a, b, c)
    with reg.cond:
        reg._checking = CheckIn("w2", 1, reg._clock())  # w2 is calling in
    reg.heartbeat(HeartbeatRequest("w2", 0, 0, 0.0))
    asked = reg.round_lost_poll(RoundLostRequest("w0", 1, 0.05, error="ValueError: x", verdict_wait_seconds=30.0))
    assert asked.answer_now() is None
    reg.heartbeat(HeartbeatRequest("w1", 0, 0, 0.0))
    reg.heartbeat(HeartbeatRequest("w2", 0, 0, 0.0))
    assert pool.submit(asked.wait).result(timeout=PROMPT).lost is False  # at --error-wait, not 30 s


def test_one_call_in_at_a_time_and_none_once_an_error_was_judged_own(reg, pool):
    a, b, c = add(reg, "w0"), add(reg, "w1"), add(reg, "w2")
    form(reg, a, b, c)
    first = pool.submit(reg.round_lost, RoundLostRequest("w0", 1, 30.0, error="ValueError: a"))
    wait_until(reg, lambda: a.asking_round == 1)
    with reg.cond:
        since = reg._called_in_at
    second = pool.submit(reg.round_lost, RoundLostRequest("w1", 1, 30.0, error="KeyError: b"))
    wait_until(reg, lambda: b.asking_round == 1)
    with reg.cond:
        assert reg._called_in_at == since  # w1 waits on w0's call-in
    reg.heartbeat(HeartbeatRequest("w2", 0, 0, 0.0))
    assert first.result(timeout=PROMPT).lost is False  # w1 asked after w0: alive too
    assert second.result(timeout=PROMPT).lost is True  # w0 leaves the round
    with reg.cond:
        assert not reg._may_call_in(1)


def test_round_lost_of_unknown_worker_is_refused(reg):
    with pytest.raises(UnknownWorker):
        reg.round_lost(RoundLostRequest("ghost", 1, wait_seconds=0.0))


# ----- report --------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", list(Outcome))
def test_report_is_recorded(reg, outcome):
    w = add(reg, "w0")
    assert outcome_of(w) is None
    report = Report("w0", 1, outcome, "msg")
    reg.report(report)
    assert w.report == report
    assert outcome_of(w) == outcome


def test_report_wakes_the_driver(reg, pool):
    w = add(reg, "w0")
    with reg.cond:
        fut = pool.submit(reg.report, Report("w0", 1, Outcome.DONE))
        assert reg.cond.wait_for(lambda: w.report is not None, PROMPT)
    fut.result(timeout=PROMPT)


def test_only_the_first_done_of_a_round_wakes_the_driver(reg):
    """Training returned once the first member says so; the others' DONE decide nothing
    until they exit (their reaps wake the driver). At the end of a job of thousands, a
    decision pass per DONE, each holding the lock the service needs, took 3.5 s."""
    members = [add(reg, f"w{i}") for i in range(3)]
    outsider = add(reg, "w3")  # not in the round (a spare, a joiner): its report always counts
    form(reg, *members)
    changes = reg.changes
    reg.report(Report("w0", 1, Outcome.DONE))
    assert reg.changes == changes + 1 and reg.reports == 1
    reg.report(Report("w1", 1, Outcome.DONE))
    reg.report(Report("w2", 1, Outcome.DONE))
    assert reg.changes == changes + 1  # recorded, counted for the saved state, not a decision
    assert reg.reports == 3 and all(m.reported_done for m in members)
    reg.report(Report("w3", 1, Outcome.DONE))
    assert reg.changes == changes + 2 and outsider.reported_done


def test_other_reports_and_a_later_rounds_first_done_wake_the_driver(reg):
    w0, w1 = add(reg, "w0"), add(reg, "w1")
    form(reg, w0, w1)
    reg.report(Report("w0", 1, Outcome.DONE))
    changes = reg.changes
    reg.report(Report("w1", 1, Outcome.FAILED, "boom"))  # not DONE: always a decision
    assert reg.changes == changes + 1
    w0.report = w1.report = None
    form(reg, w0, w1)  # (a test's shortcut: the driver forms none once training returned)
    changes = reg.changes
    reg.report(Report("w1", 2, Outcome.DONE))
    assert reg.changes == changes + 1  # round 2's own first DONE


def test_per_round_facts_stay_bounded_over_thousands_of_rounds(tmp_path):
    """A job of weeks with a host that keeps failing: a round broken and formed again
    thousands of times keeps the newest ROUNDS_KEPT rounds' facts, and its timeline still
    records every break and first step once."""
    from lightning_elastic.launcher.observe.events import EventLog, read_events
    from lightning_elastic.launcher.job.state import ROUNDS_KEPT

    reg = Registry()
    events = EventLog(tmp_path)
    members = [add(reg, f"w{i}") for i in range(2)]
    rounds = 3 * ROUNDS_KEPT + 5
    with reg.cond:
        for number in range(1, rounds + 1):
            form(reg, *members)
            reg.state.first_steps[number] = float(number)  # as a member's heartbeat reports it
            events.observe(reg.state.breaks, reg.state.first_steps, number)
            reg.mark_round_broken(number, f"worker w1 was lost in round {number}")
            reg.state.user_error_rounds.add(number)
            events.observe(reg.state.breaks, reg.state.first_steps, number)
    assert len(reg.state.breaks) == ROUNDS_KEPT and reg.state.breaks[-1].round == rounds
    assert max(reg.state.broken_rounds) == rounds and len(reg.state.broken_rounds) <= ROUNDS_KEPT + 1
    assert len(reg.state.first_steps) <= ROUNDS_KEPT + 1 and len(reg.state.user_error_rounds) <= ROUNDS_KEPT + 1
    assert len(events._breaks_seen) <= ROUNDS_KEPT and len(events._first_steps_seen) <= 2 * ROUNDS_KEPT + 1  # noqa: SLF001
    events.close()
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds.count("round_broken") == rounds and kinds.count("first_step") == rounds


def test_report_of_unknown_worker_is_refused(reg):
    with pytest.raises(UnknownWorker):
        reg.report(Report("ghost", 1, Outcome.DONE))


def test_report_of_finished_worker_is_refused(reg):
    w = add(reg, "w0")
    finish(reg, w, WorkerState.DONE)
    with pytest.raises(UnknownWorker):
        reg.report(Report("w0", 1, Outcome.FAILED))
    assert w.report is None


def test_worker_state_finished_flags():
    assert {s for s in WorkerState if s.finished} == {WorkerState.DONE, WorkerState.REMOVED, WorkerState.FAILED}


# ----- faults the driver learns from its workers ----------------------------------------


def test_a_collective_error_breaks_the_round_at_once_with_its_cause(reg):
    w0, w1 = add(reg, "w0", "a"), add(reg, "w1", "b")
    form(reg, w0, w1)
    reply = reg.round_lost(RoundLostRequest("w1", 1, 30.0, collective=True, error="DistError: timed out"))
    assert reply == RoundLostReply(True)
    assert reg.state.broken_rounds == {1}
    (only,) = reg.state.breaks
    assert only.error == "DistError: timed out" and "worker w1 left round 1" in only.cause
    assert only.slots == (SlotKey("a", 0), SlotKey("b", 0))
    # Its peer, whose collective failed because w1 left, hears "lost" at once.
    assert reg.round_lost(RoundLostRequest("w0", 1, 30.0)).lost is True


def test_a_member_back_at_the_rendezvous_unannounced_breaks_its_round(reg):
    w0, w1 = add(reg, "w0", "a"), add(reg, "w1", "b")
    form(reg, w0, w1)
    assert reg.rendezvous(RendezvousRequest("w1", 1), timeout=0.0).status == RendezvousStatus.WAIT
    assert reg.state.broken_rounds == {1}
    assert reg.state.breaks[0].cause == "worker w1 left round 1" and reg.state.breaks[0].error == ""


def test_members_back_after_an_announced_change_do_not_break_the_round(reg):
    w0, w1 = add(reg, "w0", "a"), add(reg, "w1", "b")
    form(reg, w0, w1)
    with reg.cond:
        reg.bump_generation()
    reg.rendezvous(RendezvousRequest("w1", 1), timeout=0.0)
    assert reg.state.broken_rounds == set()


def test_a_break_is_recorded_once_with_its_first_cause(reg):
    w0 = add(reg, "w0")
    form(reg, w0)
    with reg.cond:
        assert reg.mark_round_broken(1, "first") is True
        assert reg.mark_round_broken(1, "second") is False
    assert [b.cause for b in reg.state.breaks] == ["first"]


def break_with(reg: Registry, records: tuple[WorkerRecord, ...], error: str, commits: int = 0) -> RoundLostReply:
    number = form(reg, *records).number
    return reg.round_lost(RoundLostRequest(records[0].worker_id, number, 30.0, True, error, commits))


def test_the_same_collective_error_in_consecutive_rounds_ends_the_job_at_the_limit():
    reg = Registry(repeated_error_limit=3)
    members = (add(reg, "w0", "a"), add(reg, "w1", "b"))
    # Ports and times differ between rounds: numbers are masked before comparing.
    assert break_with(reg, members, "DistError: timed out after 60000 ms on port 41001").lost is True
    assert break_with(reg, members, "DistError: timed out after 60001 ms on port 41877").lost is True
    reply = break_with(reg, members, "DistError: timed out after 60000 ms on port 39999")
    assert reply.lost is False
    assert reply.reason == reg.state.repeated_error
    assert reg.state.repeated_error == (
        "the same collective error ended 3 consecutive rounds (1-3) with no commit in between: "
        "DistError: timed out after 60000 ms on port 39999"
    )


@pytest.mark.parametrize(
    "second",
    [
        dict(error="DistError: a different error"),
        dict(error="DistError: timed out", commits=1),  # progress was made
    ],
)
def test_a_changed_error_or_progress_starts_the_count_again(second):
    reg = Registry(repeated_error_limit=2)
    members = (add(reg, "w0", "a"), add(reg, "w1", "b"))
    break_with(reg, members, "DistError: timed out")
    assert break_with(reg, members, second.get("error", ""), second.get("commits", 0)).lost is True
    assert reg.state.repeated_error is None


def test_a_changed_membership_starts_the_count_again():
    reg = Registry(repeated_error_limit=2)
    a, b, c = add(reg, "w0", "a"), add(reg, "w1", "b"), add(reg, "w2", "c")
    break_with(reg, (a, b), "DistError: timed out")
    assert break_with(reg, (a, b, c), "DistError: timed out").lost is True


def test_a_limit_of_zero_never_ends_the_job():
    reg = Registry(repeated_error_limit=0)
    members = (add(reg, "w0", "a"),)
    for _ in range(5):
        assert break_with(reg, members, "DistError: timed out").lost is True


def test_a_lost_member_between_two_errors_is_not_a_repetition():
    reg = Registry(repeated_error_limit=2)
    members = (add(reg, "w0", "a"),)
    break_with(reg, members, "DistError: timed out")
    number = form(reg, *members).number
    with reg.cond:
        reg.mark_round_broken(number, "worker w9 was killed")
    assert break_with(reg, members, "DistError: timed out").lost is True


def test_a_preempted_worker_may_leave_and_is_told_to_exit_at_the_rendezvous(reg):
    w0 = add(reg, "w0")
    form(reg, w0)
    assert reg.leave(LeaveRequest("w0", "SIGTERM")) == LeaveReply(True)
    assert w0.departing == "SIGTERM" and w0.leave
    assert reg.rendezvous(RendezvousRequest("w0", 1), timeout=0.0).status == RendezvousStatus.EXIT
    assert reg.state.broken_rounds == set()  # leaving through the rendezvous loses nothing


@pytest.mark.parametrize("why", ["closing", "stopping", "done"])
def test_leave_is_refused_when_the_driver_stops_the_worker_or_training_is_over(reg, why):
    w0 = add(reg, "w0")
    form(reg, w0)
    if why == "closing":
        reg.state.closing = True
    elif why == "stopping":
        w0.stop_deadline = 0.0
    else:
        reg.report(Report("w0", 1, Outcome.DONE))
    assert reg.leave(LeaveRequest("w0", "SIGTERM")) == LeaveReply(False)
    assert w0.departing == ""


def test_leave_of_unknown_worker_is_refused(reg):
    with pytest.raises(UnknownWorker):
        reg.leave(LeaveRequest("ghost", "SIGTERM"))


# ----- classify_error: the decision itself, as a table ------------------------------------

NO_FACTS = dict(broken=False, judged_own=False, all_members_asking=False, collective=False,
                repeated_error=None, waited_out=False)


@pytest.mark.parametrize(
    ("facts", "reply"),
    [
        ({}, None),  # nothing known yet: wait
        ({"waited_out": True}, RoundLostReply(False)),
        ({"broken": True}, RoundLostReply(True)),
        ({"all_members_asking": True}, RoundLostReply(False)),
        ({"judged_own": True, "broken": True}, RoundLostReply(False)),  # sticky: later askers agree
        ({"broken": True, "all_members_asking": True}, RoundLostReply(True)),
        ({"collective": True}, RoundLostReply(True)),
        ({"collective": True, "all_members_asking": True}, RoundLostReply(True)),
        ({"collective": True, "repeated_error": "same error 3 rounds"}, RoundLostReply(False, "same error 3 rounds")),
        ({"repeated_error": "same error 3 rounds", "broken": True}, RoundLostReply(True)),
        ({"others_alive": True}, RoundLostReply(False)),  # no peer lost: its own, before the wait
        ({"failed_alike": True}, RoundLostReply(False)),
        ({"failed_alike": True, "broken": True}, RoundLostReply(False)),  # its exit broke the round
        ({"failed_other": True}, RoundLostReply(True)),
        ({"failed_other": True, "others_alive": True}, RoundLostReply(True)),
        ({"broken": True, "others_alive": True}, RoundLostReply(True)),
        ({"collective": True, "failed_alike": True}, RoundLostReply(True)),
        # Row 66: a peer silent since the question (a crashed node whose srun lingers) holds
        # the answer past --error-wait, until the driver's verdict on it breaks the round...
        ({"waited_out": True, "peer_silent": True}, None),
        ({"waited_out": True, "peer_silent": True, "broken": True}, RoundLostReply(True)),
        # ... bounded: alive but never saying so, or never judged, it is the asker's own.
        ({"waited_out": True, "peer_silent": True, "out_of_time": True}, RoundLostReply(False)),
        ({"out_of_time": True}, RoundLostReply(False)),
        # Unchanged by a silent peer: the same error everywhere, or one already judged own.
        ({"waited_out": True, "peer_silent": True, "all_members_asking": True}, RoundLostReply(False)),
        ({"waited_out": True, "peer_silent": True, "failed_alike": True}, RoundLostReply(False)),
        ({"waited_out": True, "peer_silent": True, "failed_other": True}, RoundLostReply(True)),
        ({"peer_silent": True}, None),  # before --error-wait: as before, wait
    ],
)
def test_classify_error(facts, reply):
    assert classify_error(ErrorView(**{**NO_FACTS, **facts})) == reply
