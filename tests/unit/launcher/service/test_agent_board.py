"""launcher/service/agent_board.py: agents joining, taking orders, reporting, leaving and lost,
with a clock the test moves (no network, no thread)."""

from __future__ import annotations

import signal

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.service.agent_board import AgentBoard
from lightning_elastic.launcher.service.long_poll import LongPoll
from tests.troubleshooting_rows import assert_documented

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 4.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_board(max_slots: int = 8) -> tuple[AgentBoard, Clock]:
    clock = Clock()
    return AgentBoard(max_slots, heartbeat_timeout=TIMEOUT, poll_seconds=1.0, clock=clock), clock


def elapse(board: AgentBoard, clock: Clock, seconds: float) -> None:
    """Time passing while the driver runs: its loop judges the agents every tick (a jump of
    the clock with no judgment in between is a pause of the driver, forgiven)."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 0.05)
        board.expire()


def agent_id(n: int) -> str:
    return f"{n:032x}"


def answer(reply) -> p.AgentPollReply:
    """A poll's answer now (or at its deadline): what the service would send."""
    if isinstance(reply, LongPoll):
        found = reply.answer_now()
        if found is None:
            reply.deadline = reply.clock()  # the wait is over
            found = reply.answer_now()
        return found
    return reply


def test_an_agent_that_joins_is_a_host_with_its_slots_in_the_order_they_joined():
    board, _ = make_board()
    before = board.version
    assert board.join(p.AgentJoin(agent_id(1), "pod-b", 2)).accepted
    reply = board.join(p.AgentJoin(agent_id(2), "pod-a", 1))
    assert reply.accepted and reply.poll_seconds == 1.0 and reply.heartbeat_timeout == TIMEOUT
    assert board.hosts() == [HostSlots("pod-b", 2), HostSlots("pod-a", 1)]
    assert board.version > before and board.serves("pod-a")


def test_a_second_agent_for_a_connected_host_name_is_refused_in_one_line(caplog):
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    refused = board.join(p.AgentJoin(agent_id(2), "pod-a", 1))
    assert not refused.accepted and "another agent is connected for host pod-a" in refused.reason
    assert "--host-name" in refused.reason
    assert board.hosts() == [HostSlots("pod-a", 1)]
    # The same agent again (its reply was lost) is still welcome, and still one host.
    assert board.join(p.AgentJoin(agent_id(1), "pod-a", 1)).accepted
    assert len([r for r in caplog.records if "Refused an agent" in r.getMessage()]) == 1


@pytest.mark.parametrize("host, slots, expected", [
    ("pod-a", 9, "--slots 9 is more than the job's --max-np 8"),
    ("pod-a", 0, "--slots: expected 1..4096, got 0"),
    ("bad host;rm", 1, "is not a machine's name"),
    ("", 1, "is not a machine's name"),
])
def test_bad_offers_are_refused_with_a_line_naming_what_was_expected(host, slots, expected):
    board, _ = make_board()
    reply = board.join(p.AgentJoin(agent_id(1), host, slots))
    assert not reply.accepted and expected in reply.reason
    assert board.hosts() == []


def test_a_start_is_an_order_the_agents_poll_takes_once_and_in_order():
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 2))
    fate, _ = board.start("pod-a", "w1", ("python", "t.py"), {"RANK": "0"}, "/work")
    board.signal("w1", signal.SIGTERM)
    orders = answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0))).orders
    assert [(o.number, o.kind, o.worker_id) for o in orders] == [
        (1, p.AgentOrderKind.START, "w1"), (2, p.AgentOrderKind.SIGNAL, "w1")]
    assert orders[0].command == ("python", "t.py") and orders[0].env == ("RANK=0",) and orders[0].cwd == "/work"
    assert orders[1].signal == signal.SIGTERM
    # A poll that carried them out acknowledges them; one whose reply was lost gets them again.
    assert answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 1))).orders == orders[1:]
    assert answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 2))).orders == ()
    assert fate.status is None


def test_a_waiting_poll_is_answered_as_soon_as_an_order_comes():
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    poll = board.poll(p.AgentPoll(agent_id(1), 1.0, 0))
    assert isinstance(poll, LongPoll) and poll.answer_now() is None
    board.start("pod-a", "w1", ("x",), {}, "/")
    assert [o.worker_id for o in poll.answer_now().orders] == ["w1"]


def test_reported_events_are_taken_once_in_order_and_make_the_workers_fate():
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    fate, output = board.start("pod-a", "w1", ("x",), {}, "/")
    events = (p.AgentEvent(1, p.AgentEventKind.STARTED, "w1", pid=4242),
              p.AgentEvent(2, p.AgentEventKind.OUTPUT, "w1", output="hello\n"),
              p.AgentEvent(3, p.AgentEventKind.EXITED, "w1", signal=signal.SIGKILL))
    assert board.report(p.AgentReport(agent_id(1), events[:2])).through == 2
    assert fate.pid == 4242 and fate.status is None
    # A retried report repeats an event: taken once; one past a gap waits for the gap.
    assert board.report(p.AgentReport(agent_id(1), events[1:])).through == 3
    assert fate.status == -signal.SIGKILL and not fate.host_gone and fate.detail == ""
    assert output.read1() == b"hello\n" and output.read1() == b""  # its output, then EOF


def test_an_agent_silent_past_the_heartbeat_timeout_is_lost_with_its_workers_and_its_host():
    board, clock = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    board.join(p.AgentJoin(agent_id(2), "pod-b", 1))
    fate, _ = board.start("pod-a", "w1", ("x",), {}, "/")
    elapse(board, clock, TIMEOUT / 2)
    answer(board.poll(p.AgentPoll(agent_id(2), 1.0, 0)))  # pod-b is heard from, pod-a is not
    elapse(board, clock, TIMEOUT / 2 + 0.1)
    board.check("w1")
    assert fate.status == -signal.SIGKILL and fate.host_gone and "its agent on pod-a was lost" in fate.detail
    version = board.version
    board.expire()
    assert board.hosts() == [HostSlots("pod-b", 1)] and board.version == version
    # Its late poll is told it was dropped; it may join again as a new host.
    reply = answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0)))
    assert reply.dropped and not reply.ended and "heard nothing from it" in reply.reason
    assert board.join(p.AgentJoin(agent_id(3), "pod-a", 1)).accepted


def test_a_leaving_agent_is_off_the_list_at_once_and_forgotten_when_gone():
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    fate, _ = board.start("pod-a", "w1", ("x",), {}, "/")
    version = board.version
    board.leave(p.AgentLeave(agent_id(1)))
    assert board.hosts() == [] and board.version > version
    assert fate.status is None  # its workers leave the job at their next check, not here
    board.report(p.AgentReport(agent_id(1), (p.AgentEvent(1, p.AgentEventKind.EXITED, "w1"),)))
    assert fate.status == 0
    board.leave(p.AgentLeave(agent_id(1), gone=True))
    assert not board.serves("pod-a")
    assert board.join(p.AgentJoin(agent_id(2), "pod-a", 1)).accepted  # its host may come back


def test_a_start_on_a_host_whose_agent_is_gone_is_a_worker_lost_with_it():
    board, _ = make_board()
    fate, output = board.start("pod-x", "w1", ("x",), {}, "/")
    assert fate.status == -signal.SIGKILL and fate.host_gone and output.read1() == b""


def test_at_the_jobs_end_every_agents_poll_says_so():
    board, _ = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    poll = board.poll(p.AgentPoll(agent_id(1), 1.0, 0))
    board.close()
    reply = poll.answer_now()
    assert reply.dropped and reply.ended and reply.reason == "the job ended"
    assert not board.join(p.AgentJoin(agent_id(2), "pod-b", 1)).accepted


def test_an_agent_whose_waiting_poll_closed_is_lost_unless_it_polls_again_within_the_grace():
    from lightning_elastic.launcher.service.agent_board import CLOSED_GRACE

    board, clock = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    board.join(p.AgentJoin(agent_id(2), "pod-b", 1))
    fate, _ = board.start("pod-a", "w1", ("x",), {}, "/")
    answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0)))  # takes its start order
    for n in (1, 2):
        poll = board.poll(p.AgentPoll(agent_id(n), 1.0, 1 if n == 1 else 0))
        assert poll.answer_now() is None
        poll._finish()  # (what the service runs when the connection closes under a waiting poll)
    elapse(board, clock, CLOSED_GRACE / 2)
    answer(board.poll(p.AgentPoll(agent_id(2), 1.0, 0)))  # pod-b comes back: a broken connection
    elapse(board, clock, CLOSED_GRACE / 2 + 0.1)
    board.expire()
    assert board.hosts() == [HostSlots("pod-b", 1)]
    assert fate.status == -signal.SIGKILL and fate.host_gone and "its connection closed" in fate.detail
    assert clock.now - 100.0 < TIMEOUT  # sooner than the heartbeat timeout


def test_output_past_the_held_bound_is_dropped_and_said_where_the_gap_is_and_once_in_the_log(monkeypatch, caplog):
    from lightning_elastic.launcher.service import agent_board

    monkeypatch.setattr(agent_board, "OUTPUT_HELD", 16)
    queue = agent_board.OutputQueue("pod-a[0]")
    queue.put(b"0123456789ab")  # 12 held, mid-line
    queue.put(b"cdefgh\n")  # 19 > 16: dropped
    queue.put(b"ijklmnop\n")  # dropped too: one gap
    assert queue.read1() == b"0123456789ab"  # drained: room again
    queue.put(b"after\n")
    assert queue.read1() == b"\n[16 bytes of output dropped: more than 0 MiB waiting for the driver's output]\nafter\n"
    for _ in range(3):
        queue.put(b"x" * 17)  # a gap at the end: said before EOF
    queue.close()
    assert queue.read1().startswith(b"[51 bytes of output dropped") and queue.read1() == b""
    assert queue.dropped == 16 + 51
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 1 and "Output of worker pod-a[0] dropped" in said[0]


def test_an_agent_for_a_host_the_host_source_lists_is_refused_in_one_line():
    board, _ = make_board()
    board.list_hosts(frozenset({"node-1"}))
    refused = board.join(p.AgentJoin(agent_id(1), "node-1", 1))
    assert not refused.accepted and "host node-1 is in the job's host list (-H or the discovery script)" in refused.reason
    assert "another --host-name" in refused.reason and board.hosts() == [] and not board.serves("node-1")
    assert_documented(f"the driver at 10.0.0.1:29400 refused this agent: {refused.reason}")
    assert board.join(p.AgentJoin(agent_id(2), "pod-a", 1)).accepted


def test_a_new_agent_for_a_host_whose_agent_is_not_heard_from_replaces_it(caplog):
    # A pod or container restarted under the same name (a StatefulSet's pod-0): the old
    # agent's poll connection closed with its process, and the new one joins before the
    # old is noticed lost.
    board, clock = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-0", 1))
    fate, _ = board.start("pod-0", "w1", ("x",), {}, "/")
    poll = board.poll(p.AgentPoll(agent_id(1), 1.0, 0))
    poll.answer_now()
    poll._finish()  # answered: still heard from
    poll = board.poll(p.AgentPoll(agent_id(1), 1.0, 1))
    assert poll.answer_now() is None
    poll._finish()  # its waiting poll's connection closed (its process killed)
    clock.now += 0.1  # well within CLOSED_GRACE: not lost yet
    assert board.join(p.AgentJoin(agent_id(2), "pod-0", 1)).accepted
    assert fate.status == -signal.SIGKILL and fate.host_gone and "replaced by a new one" in fate.detail
    assert board.hosts() == [HostSlots("pod-0", 1)]
    [said] = [r.getMessage() for r in caplog.records if "Agent on pod-0 replaced" in r.getMessage()]
    assert_documented(said)
    late = answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 1)))  # the old one, if it ever polls again
    assert late.dropped and "a new agent joined for this host" in late.reason
    # ... and the new one, polling, is live: a third with the name is refused.
    answer(board.poll(p.AgentPoll(agent_id(2), 1.0, 0)))
    refused = board.join(p.AgentJoin(agent_id(3), "pod-0", 1))
    assert not refused.accepted and "another agent is connected for host pod-0" in refused.reason


def test_a_silent_agent_is_replaced_by_a_newcomer_before_the_heartbeat_timeout():
    from lightning_elastic.launcher.service.agent_board import CLOSED_GRACE

    board, clock = make_board()  # poll period 1 s: a live agent starts a poll at least this often
    board.join(p.AgentJoin(agent_id(1), "pod-0", 1))
    elapse(board, clock, 1.0 + CLOSED_GRACE / 2)
    assert not board.join(p.AgentJoin(agent_id(2), "pod-0", 1)).accepted  # may still be polling
    elapse(board, clock, CLOSED_GRACE / 2 + 0.1)
    assert clock.now - 100.0 < TIMEOUT  # not lost yet by the heartbeat timeout
    assert board.join(p.AgentJoin(agent_id(2), "pod-0", 1)).accepted


def test_a_pause_of_the_driver_is_no_agents_silence():
    # The driver stopped for three heartbeat timeouts (SIGSTOP, a frozen container): no
    # agent could be heard meanwhile. On its return its loop judges before the service has
    # read the agents' waiting polls: no agent is lost for that.
    board, clock = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    board.join(p.AgentJoin(agent_id(2), "pod-b", 1))
    fate, _ = board.start("pod-a", "w1", ("x",), {}, "/")
    for _ in range(10):  # the loop judging every tick
        clock.now += 0.05
        board.check("w1")
    clock.now += 3 * TIMEOUT  # away
    board.check("w1")
    board.expire()
    assert fate.status is None and board.hosts() == [HostSlots("pod-a", 1), HostSlots("pod-b", 1)]
    answer(board.poll(p.AgentPoll(agent_id(2), 1.0, 0)))  # pod-b's poll read: heard, not dropped
    assert board.serves("pod-b")
    # Back and running, silence counts again: pod-a, never heard after the pause, is lost
    # a heartbeat timeout later (judged each tick meanwhile).
    for _ in range(int(TIMEOUT / 0.5)):
        clock.now += 0.5
        board.expire()
        assert fate.status is None
    clock.now += 0.5
    board.check("w1")
    assert fate.status == -signal.SIGKILL and fate.host_gone and board.hosts() == [HostSlots("pod-b", 1)]


def test_a_pause_does_not_hide_a_closed_connection_for_long():
    from lightning_elastic.launcher.service.agent_board import CLOSED_GRACE

    board, clock = make_board()
    board.join(p.AgentJoin(agent_id(1), "pod-a", 1))
    poll = board.poll(p.AgentPoll(agent_id(1), 1.0, 0))
    poll._finish()  # closed just before the pause
    clock.now += 3 * TIMEOUT
    board.expire()
    assert board.serves("pod-a")  # the grace starts again with the driver's return
    elapse(board, clock, CLOSED_GRACE / 2)
    board.expire()
    elapse(board, clock, CLOSED_GRACE / 2 + 0.1)
    board.expire()
    assert not board.serves("pod-a")
