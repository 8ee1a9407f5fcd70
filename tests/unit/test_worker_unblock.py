"""A round's lost member cuts that round's gloo connections (or aborts its NCCL
communicator), never a later round's.

NCCL: no GPU here, so only the decision is tested (which group, under the lock), with the
abort itself replaced."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lightning_elastic import protocol as p
from lightning_elastic.membership import worker as worker_module
from lightning_elastic.membership.process_group import BackendChoice
from lightning_elastic.membership.stuck_round import Action, StuckRoundWatch
from lightning_elastic.membership.worker import ElasticWorker
from tests.troubleshooting_rows import documented_row

ROUND_1_CONNECTIONS = frozenset({(("127.0.0.1", 1000), ("127.0.0.1", 2000))})
ROUND_2_CONNECTIONS = frozenset({(("127.0.0.1", 1001), ("127.0.0.1", 2001))})


def assignment(round_: int) -> p.Assignment:
    return p.Assignment(round_, 0, 2, 0, 1, 0, 2, "localhost", "127.0.0.1", 1, 0)


@pytest.fixture
def cut(monkeypatch: pytest.MonkeyPatch) -> list[frozenset]:
    calls: list[frozenset] = []
    monkeypatch.setattr(worker_module.group_sockets, "shut_down", lambda c: calls.append(c) or len(c))
    return calls


def test_the_broken_rounds_connections_are_cut(cut: list[frozenset]) -> None:
    w = ElasticWorker(None)
    w._assignment = assignment(1)
    w._group_connections = (1, ROUND_1_CONNECTIONS)
    w._unblock_collectives(1)
    assert cut == [ROUND_1_CONNECTIONS]


def test_a_worker_already_in_the_next_round_cuts_nothing(cut: list[frozenset]) -> None:
    w = ElasticWorker(None)
    w._assignment = assignment(2)
    w._group_connections = (2, ROUND_2_CONNECTIONS)
    w._unblock_collectives(1)
    assert cut == []


def test_the_next_rounds_group_formed_after_the_assignment_was_read_is_left_alone(cut: list[frozenset]) -> None:
    # The main thread moved on between the heartbeat's two reads: the assignment still says
    # round 1 but the connections already belong to round 2's group.
    w = ElasticWorker(None)
    w._assignment = assignment(1)
    w._group_connections = (2, ROUND_2_CONNECTIONS)
    w._unblock_collectives(1)
    assert cut == []


# ----- NCCL: decisions only (there is no GPU here; the abort itself is faked) -------------


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each destroy of the NCCL group, recorded with its abort flag."""
    calls: list[bool] = []
    monkeypatch.setattr(worker_module, "destroy_round_group", lambda abort=False: calls.append(abort))
    return calls


def nccl_worker(assigned: int, formed_in: int) -> ElasticWorker:
    w = ElasticWorker(None)
    w._backend = BackendChoice("nccl", torch.device("cpu"))  # the device is not touched
    w._assignment = assignment(assigned)
    w._group_connections = (formed_in, frozenset())
    return w


def test_nccl_aborts_the_broken_rounds_group_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    w = nccl_worker(assigned=1, formed_in=1)
    held: list[bool] = []
    monkeypatch.setattr(worker_module, "destroy_round_group", lambda abort=False: held.append(abort and w._lock.locked()))
    w._unblock_collectives(1)
    assert held == [True]
    assert w._group_connections[0] == 0  # aborted once: a second heartbeat leaves it alone
    w._unblock_collectives(1)
    assert held == [True]


def test_nccl_leaves_the_next_rounds_group_formed_after_the_assignment_was_read(aborts: list[bool]) -> None:
    # Before: the abort went by the assignment (round 1, read without the lock) and aborted
    # round 2's healthy communicator.
    nccl_worker(assigned=1, formed_in=2)._unblock_collectives(1)
    assert aborts == []


def test_nccl_leaves_alone_a_group_being_destroyed_or_not_yet_formed(aborts: list[bool]) -> None:
    w = nccl_worker(assigned=1, formed_in=1)
    w._forget_group()  # what reset() and shutdown() do first
    w._unblock_collectives(1)
    assert aborts == []


# ----- a worker that stays in the broken round after the cut (stuck_round) -----------------


def test_the_watch_reports_then_exits_only_while_the_main_thread_stays_in_the_cut_round() -> None:
    watch = StuckRoundWatch(warn_after=10.0, exit_after=120.0)
    assert watch.check(5, 0.0) is Action.NONE  # nothing was cut
    watch.cut(5, 100.0)
    assert watch.check(5, 105.0) is Action.NONE
    assert watch.check(5, 110.0) is Action.REPORT
    assert watch.check(5, 150.0) is Action.NONE  # reported once
    assert watch.check(5, 220.0) is Action.EXIT
    watch.cut(6, 300.0)
    assert watch.check(0, 400.0) is Action.NONE  # the main thread reset: forgotten
    assert watch.check(7, 900.0) is Action.NONE


def test_a_worker_still_in_the_cut_round_cuts_again_shows_its_stack_then_exits(
        cut: list[frozenset], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    w = ElasticWorker(None)
    w._assignment = assignment(1)
    w._group_connections = (1, ROUND_1_CONNECTIONS)
    w._training_thread = threading.get_ident()
    w._stuck = StuckRoundWatch(warn_after=0.0, exit_after=3600.0)
    w._unblock_collectives(1)
    w._watch_broken_round()
    assert cut == [ROUND_1_CONNECTIONS, ROUND_1_CONNECTIONS]
    err = capsys.readouterr().err
    assert "round 1 lost a member 0 s ago and this worker is still in it (1 of its 1 connection(s) cut again)" in err
    assert "test_a_worker_still_in_the_cut_round_cuts_again_shows_its_stack_then_exits" in err  # this thread's stack
    assert documented_row(err.splitlines()[0]), "docs/troubleshooting.md has no row for it"
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    w._stuck = StuckRoundWatch(warn_after=0.0, exit_after=0.0)
    w._stuck.cut(1, 0.0)
    w._watch_broken_round()
    assert exits == [1]
    line = capsys.readouterr().err.strip()
    assert line.startswith("lightning-elastic: still in round 1 ") and documented_row(line), line
    w.reported = p.Outcome.DONE  # after training returned, never
    w._watch_broken_round()
    assert exits == [1]
