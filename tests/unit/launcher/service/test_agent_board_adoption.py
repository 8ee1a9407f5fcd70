"""launcher/service/agent_board.py across a driver restart (--state-dir): the workers the
saved state has on agents' hosts are awaited, adopted from the agent that lists them at its
join, and lost when it does not; a clock the test moves (no network, no thread)."""

from __future__ import annotations

import signal

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.service.agent_board import AgentBoard
from tests.unit.launcher.service.test_agent_board import TIMEOUT, Clock, agent_id, answer, elapse

pytestmark = pytest.mark.timeout(30)

PATIENCE = 60.0


def restarted_board() -> tuple[AgentBoard, Clock]:
    """A driver's board right after it adopted a job: pod-a ran w1 (pid 101) and w2 (pid 102
    on slot 1), pod-b ran w3 (its pid not saved yet)."""
    clock = Clock()
    board = AgentBoard(8, heartbeat_timeout=TIMEOUT, poll_seconds=1.0, clock=clock, patience=PATIENCE)
    board.expect("pod-a", "w1", 0, 101)
    board.expect("pod-a", "w2", 1, 102)
    board.expect("pod-b", "w3", 0, 0)
    return board, clock


def running(worker_id: str, pid: int) -> p.AgentWorker:
    return p.AgentWorker(worker_id, pid)


def test_the_welcome_gives_the_patience_and_without_state_dir_none():
    board, _ = restarted_board()
    assert board.join(p.AgentJoin(agent_id(1), "pod-c", 1)).patience == PATIENCE
    plain = AgentBoard(8, heartbeat_timeout=TIMEOUT, poll_seconds=1.0, clock=Clock())
    assert plain.join(p.AgentJoin(agent_id(1), "pod-c", 1)).patience == 0.0


def test_awaited_hosts_are_offered_with_their_slots_until_their_agents_are_back():
    board, _ = restarted_board()
    assert board.hosts() == [HostSlots("pod-a", 2), HostSlots("pod-b", 1)]
    assert board.serves("pod-a") and board.serves("pod-b")
    board.join(p.AgentJoin(agent_id(1), "pod-a", 4, (running("w1", 101), running("w2", 102))))
    assert board.hosts() == [HostSlots("pod-a", 4), HostSlots("pod-b", 1)]


def test_an_agent_that_lists_its_workers_has_them_adopted_same_pids_and_their_events_taken():
    board, _ = restarted_board()
    # (the fate the driver's AgentProcess reads; expected again, the entry is replaced)
    w1, out1 = board.expect("pod-a", "w1", 0, 101)
    reply = board.join(p.AgentJoin(agent_id(1), "pod-a", 2, (running("w1", 101), running("w2", 102))))
    assert reply.accepted and set(reply.adopted) == {"w1", "w2"}
    assert w1.pid == 101 and w1.status is None
    # Its events, numbered afresh for this driver, reach the adopted workers.
    events = (p.AgentEvent(1, p.AgentEventKind.OUTPUT, "w1", output="epoch 3\n"),
              p.AgentEvent(2, p.AgentEventKind.EXITED, "w1", status=0))
    assert board.report(p.AgentReport(agent_id(1), events)).through == 2
    assert w1.status == 0 and out1.read1() == b"epoch 3\n"


def test_a_repeated_join_whose_reply_was_lost_names_the_same_adopted_workers():
    board, _ = restarted_board()
    join = p.AgentJoin(agent_id(1), "pod-a", 2, (running("w1", 101), running("w2", 102)))
    first = board.join(join)
    assert board.join(join).adopted == first.adopted == ("w1", "w2")


def test_a_worker_not_saved_another_hosts_or_with_another_pid_is_not_adopted_and_the_missing_are_lost():
    board, _ = restarted_board()
    w1, _ = board.expect("pod-a", "w1", 0, 101)
    w2, _ = board.expect("pod-a", "w2", 1, 102)
    listed = (running("w1", 999),  # another process under w1's name: not ours
              running("w3", 103),  # pod-b's worker, claimed by pod-a's agent
              running("w9", 109))  # started by the old driver and never saved
    reply = board.join(p.AgentJoin(agent_id(1), "pod-a", 2, listed))
    assert reply.accepted and reply.adopted == ()
    # pod-a's awaited workers it did not list (by id and pid) are lost with their host.
    for fate in (w1, w2):
        assert fate.status == -signal.SIGKILL and fate.host_gone and "came back without it" in fate.detail
    # pod-b's w3 is still awaited, and its own agent (the pid was not saved) adopts it.
    assert board.join(p.AgentJoin(agent_id(2), "pod-b", 1, (running("w3", 103),))).adopted == ("w3",)


def test_a_worker_that_ended_while_no_driver_ran_is_adopted_with_its_status():
    board, _ = restarted_board()
    w1, out = board.expect("pod-a", "w1", 0, 101)
    board.join(p.AgentJoin(agent_id(1), "pod-a", 2, (p.AgentWorker("w1", 101, running=False, signal=9),
                                                       running("w2", 102))))
    assert w1.status == -9 and not w1.host_gone
    assert out.read1() == b""  # its output ends


def test_awaited_workers_whose_agent_does_not_come_back_are_lost_after_the_heartbeat_timeout():
    board, clock = restarted_board()
    w3, _ = board.expect("pod-b", "w3", 0, 0)
    board.join(p.AgentJoin(agent_id(1), "pod-a", 2, (running("w1", 101), running("w2", 102))))
    elapse(board, clock, TIMEOUT / 2)
    answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0)))
    board.check("w3")
    assert w3.status is None
    elapse(board, clock, TIMEOUT / 2 + 0.2)
    answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0)))
    board.check("w3")
    assert w3.status == -signal.SIGKILL and w3.host_gone and "did not join the restarted driver" in w3.detail
    assert board.hosts() == [HostSlots("pod-a", 2)]
    # Its agent, back too late, keeps none of them.
    assert board.join(p.AgentJoin(agent_id(2), "pod-b", 1, (running("w3", 103),))).adopted == ()


def test_a_driver_pause_is_not_counted_against_the_awaited_agents():
    board, clock = restarted_board()
    w1, _ = board.expect("pod-a", "w1", 0, 101)
    clock.now += 10 * TIMEOUT  # the driver itself stopped (no judging call in between)
    board.check("w1")
    assert w1.status is None


def test_a_signal_for_an_awaited_worker_is_ordered_once_its_agent_is_back():
    board, _ = restarted_board()
    board.signal("w1", signal.SIGTERM)
    board.join(p.AgentJoin(agent_id(1), "pod-a", 2, (running("w1", 101), running("w2", 102))))
    orders = answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0))).orders
    assert [(o.kind, o.worker_id, o.signal) for o in orders] == [(p.AgentOrderKind.SIGNAL, "w1", signal.SIGTERM)]


def test_an_unknown_agents_poll_is_told_so_and_a_dropped_one_is_not():
    board, clock = restarted_board()
    reply = answer(board.poll(p.AgentPoll(agent_id(7), 1.0, 0)))
    assert reply.dropped and reply.unknown and not reply.ended  # the previous driver's agent
    board.join(p.AgentJoin(agent_id(1), "pod-c", 1))
    elapse(board, clock, TIMEOUT + 0.5)
    reply = answer(board.poll(p.AgentPoll(agent_id(1), 1.0, 0)))
    assert reply.dropped and not reply.unknown  # lost by this driver: its workers are gone


def test_a_join_listing_malformed_or_too_many_workers_is_refused_in_one_line():
    board, _ = restarted_board()
    bad = board.join(p.AgentJoin(agent_id(1), "pod-a", 2, (p.AgentWorker("x" * 201, 1),)))
    assert not bad.accepted and "malformed worker" in bad.reason
    many = tuple(running(f"w{i}", i) for i in range(4097))
    assert not board.join(p.AgentJoin(agent_id(1), "pod-a", 2, many)).accepted


def test_closing_the_board_ends_the_awaited_workers():
    board, _ = restarted_board()
    w3, out = board.expect("pod-b", "w3", 0, 0)
    board.close()
    assert w3.status == -signal.SIGKILL and out.read1() == b""
