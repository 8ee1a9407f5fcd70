"""ServiceGc: rarer young collections, the long-lived heap frozen, renewed when quiet, undone at the end."""

from __future__ import annotations

import gc

from lightning_elastic.launcher.driver.gc_policy import REFORM_HOLD, REFRESH_AFTER, YOUNG_THRESHOLD, ServiceGc


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_heap_is_frozen_at_start_and_after_each_round_and_everything_is_undone_at_the_end() -> None:
    before = gc.get_threshold()
    clock = Clock()
    policy = ServiceGc(clock)
    try:
        policy.start()
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        frozen = gc.get_freeze_count()
        assert frozen > 0
        records = [[n] for n in range(1000)]  # a round's records: containers the collector tracks
        policy.round_formed()
        assert gc.get_freeze_count() >= frozen + len(records)
    finally:
        policy.stop()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_cyclic_garbage_among_frozen_objects_is_collected_once_the_job_is_quiet() -> None:
    clock = Clock()
    policy = ServiceGc(clock)
    try:
        policy.start()

        class Node:
            pass

        a, b = Node(), Node()
        a.peer, b.peer = b, a  # a cycle, frozen with the round, then dropped
        policy.round_formed()
        collected = gc.get_freeze_count()
        del a, b
        clock.now = REFRESH_AFTER - 1
        policy.tick()
        assert gc.get_freeze_count() == collected  # not yet: a round formed recently
        clock.now = REFRESH_AFTER + 1
        policy.tick()
        assert gc.get_freeze_count() < collected  # the cycle was collected, the rest frozen again
    finally:
        policy.stop()


def test_no_collection_while_a_round_re_forms_until_it_forms_or_the_hold_runs_out() -> None:
    clock = Clock()
    policy = ServiceGc(clock)
    try:
        policy.reforming()
        assert gc.isenabled()  # not started: the policy changes nothing
        policy.start()
        policy.reforming()
        assert not gc.isenabled()
        policy.round_formed()
        assert gc.isenabled()

        clock.now = 100.0
        policy.reforming()  # the next re-formation, which does not form in time
        clock.now += REFORM_HOLD - 1
        policy.tick()
        assert not gc.isenabled()
        clock.now += 2
        policy.tick()
        assert gc.isenabled()
        policy.reforming()  # the same re-formation's next decision pass: no second hold
        assert gc.isenabled()
        policy.round_formed()
        policy.reforming()  # a new one holds again
        assert not gc.isenabled()
    finally:
        policy.stop()
    assert gc.isenabled()


def test_the_quiet_job_refresh_waits_for_a_re_formation_to_end() -> None:
    clock = Clock()
    policy = ServiceGc(clock)
    try:
        policy.start()

        class Node:
            pass

        a, b = Node(), Node()
        a.peer, b.peer = b, a  # a cycle, frozen with the round, then dropped
        policy.round_formed()
        del a, b
        frozen = gc.get_freeze_count()
        clock.now = REFRESH_AFTER + 1  # quiet long enough, but a round re-forms now
        policy.reforming()
        clock.now += REFORM_HOLD + 1
        policy.tick()  # the hold ran out, the re-formation goes on: still no full collection
        assert gc.get_freeze_count() == frozen
        policy.round_formed()
        clock.now += REFRESH_AFTER + 1
        policy.tick()
        assert gc.get_freeze_count() < frozen  # quiet after the round: the cycle is collected
    finally:
        policy.stop()
