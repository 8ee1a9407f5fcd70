"""A round's lost member cuts that round's gloo connections, never a later round's."""

from __future__ import annotations

import pytest

from lightning_elastic import protocol as p
from lightning_elastic import worker as worker_module
from lightning_elastic.worker import ElasticWorker

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
