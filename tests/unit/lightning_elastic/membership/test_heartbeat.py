"""lightning_elastic/membership/heartbeat.py: a round's lost member cuts that round's gloo
connections (or aborts its NCCL communicator), never a later round's.

The heartbeat acts on ``SharedState.group``, the group that exists now, never on the
assignment the training thread holds. NCCL: no GPU here, so only the decision is tested
(which group, under the lock), with the abort itself replaced."""

from __future__ import annotations

import os
import threading
from typing import cast

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.membership import heartbeat as heartbeat_module
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.membership.heartbeat import Heartbeat
from lightning_elastic.membership.settings import WorkerSettings
from lightning_elastic.membership.shared import FormedGroup, SharedState
from lightning_elastic.membership.stuck_round import Action, StuckRoundWatch
from tests.troubleshooting_rows import documented_row

ROUND_1_CONNECTIONS = frozenset({(("127.0.0.1", 1000), ("127.0.0.1", 2000))})
ROUND_2_CONNECTIONS = frozenset({(("127.0.0.1", 1001), ("127.0.0.1", 2001))})


def heartbeat_over(group: FormedGroup) -> Heartbeat:
    """A heartbeat whose worker formed ``group`` (it never beats here: no settings or client needed)."""
    shared = SharedState()
    shared.group = group
    return Heartbeat(cast(WorkerSettings, None), cast(DriverClient, None), shared)


@pytest.fixture
def cut(monkeypatch: pytest.MonkeyPatch) -> list[frozenset]:
    calls: list[frozenset] = []
    monkeypatch.setattr(heartbeat_module.group_sockets, "shut_down", lambda c: calls.append(c) or len(c))
    return calls


def test_the_broken_rounds_connections_are_cut(cut: list[frozenset]) -> None:
    heartbeat_over(FormedGroup(1, ROUND_1_CONNECTIONS, nccl=False)).unblock_collectives(1)
    assert cut == [ROUND_1_CONNECTIONS]


def test_a_worker_already_in_the_next_round_cuts_nothing(cut: list[frozenset]) -> None:
    heartbeat_over(FormedGroup(2, ROUND_2_CONNECTIONS, nccl=False)).unblock_collectives(1)
    assert cut == []


def test_a_worker_between_groups_cuts_nothing(cut: list[frozenset]) -> None:
    # The training thread marked round 1's group gone (it is being destroyed) and has not
    # formed round 2's yet: there is nothing to cut.
    beat = heartbeat_over(FormedGroup(1, ROUND_1_CONNECTIONS, nccl=False))
    assert beat.shared.forget_group() == ROUND_1_CONNECTIONS  # what reset() and shutdown() do first
    beat.unblock_collectives(1)
    assert cut == []


# ----- NCCL: decisions only (there is no GPU here; the abort itself is faked) -------------


@pytest.fixture
def aborts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each destroy of the NCCL group, recorded with its abort flag."""
    calls: list[bool] = []
    monkeypatch.setattr(heartbeat_module, "destroy_round_group", lambda abort=False: calls.append(abort))
    return calls


def test_nccl_aborts_the_broken_rounds_group_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    beat = heartbeat_over(FormedGroup(1, frozenset(), nccl=True))
    held: list[bool] = []
    monkeypatch.setattr(heartbeat_module, "destroy_round_group",
                        lambda abort=False: held.append(abort and beat.shared.lock.locked()))
    beat.unblock_collectives(1)
    assert held == [True]
    assert beat.shared.group.round == 0  # aborted once: a second heartbeat leaves it alone
    beat.unblock_collectives(1)
    assert held == [True]


def test_nccl_leaves_the_next_rounds_group_alone(aborts: list[bool]) -> None:
    # Before: the abort went by the assignment (round 1, read without the lock) and aborted
    # round 2's healthy communicator, formed meanwhile.
    heartbeat_over(FormedGroup(2, frozenset(), nccl=True)).unblock_collectives(1)
    assert aborts == []


def test_nccl_leaves_alone_a_group_being_destroyed_or_not_yet_formed(aborts: list[bool]) -> None:
    beat = heartbeat_over(FormedGroup(1, frozenset(), nccl=True))
    beat.shared.forget_group()  # what reset() and shutdown() do first
    beat.unblock_collectives(1)
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
    w = heartbeat_over(FormedGroup(1, ROUND_1_CONNECTIONS, nccl=False))
    w.shared.training_thread = threading.get_ident()
    w.stuck = StuckRoundWatch(warn_after=0.0, exit_after=3600.0)
    w.unblock_collectives(1)
    w.watch_broken_round()
    assert cut == [ROUND_1_CONNECTIONS, ROUND_1_CONNECTIONS]
    err = capsys.readouterr().err
    assert "round 1 lost a member 0 s ago and this worker is still in it (1 of its 1 connection(s) cut again)" in err
    assert "test_a_worker_still_in_the_cut_round_cuts_again_shows_its_stack_then_exits" in err  # this thread's stack
    assert documented_row(err.splitlines()[0]), "docs/troubleshooting.md has no row for it"
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    w.stuck = StuckRoundWatch(warn_after=0.0, exit_after=0.0)
    w.stuck.cut(1, 0.0)
    w.watch_broken_round()
    assert exits == [1]
    line = capsys.readouterr().err.strip()
    assert line.startswith("lightning-elastic: still in round 1 ") and documented_row(line), line
    w.shared.reported = p.Outcome.DONE  # after training returned, never
    w.watch_broken_round()
    assert exits == [1]
