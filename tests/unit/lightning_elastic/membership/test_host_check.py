"""lightning_elastic/membership/host_check.py: every rank raises at the same call; fast calls share collectives.

Ranks are simulated in one process: a ``Collective`` completes an all-reduce once every
rank has contributed to it, as gloo would. One test runs the real collective on real gloo
ranks.
"""

from __future__ import annotations

import pytest
import torch

from lightning_elastic.errors import HostsUpdatedInterrupt
from lightning_elastic.membership.host_check import CHECK_PERIOD_S, MAX_CALLS_APART, HostCheck, calls_until_next
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("elapsed", "calls", "expected"),
    [
        (0.0, 0, 1),  # nothing measured yet
        (0.5, 1, 1),  # calls slower than the period: a collective at every call
        (CHECK_PERIOD_S, 1, 1),
        (0.01, 1, 2),  # 10 ms per call, but at most twice the last spacing of 1 call
        (0.05, 5, 10),  # 10 ms per call, 5 calls apart: 10
        (0.04, 8, 16),  # 5 ms per call: 20 per period, at most twice 8
        (0.08, 16, MAX_CALLS_APART),  # 5 ms per call, 16 apart: 20, the cap
        (1e-9, 1, 2),  # one burst of calls doubles the spacing, no more
        (1e-9, 19, MAX_CALLS_APART),  # absurdly fast calls are capped
        (-1.0, 3, 1),  # a clock that went backwards proves nothing
    ],
)
def test_calls_until_next(elapsed: float, calls: int, expected: int) -> None:
    assert calls_until_next(elapsed, calls) == expected


class _Work:
    def __init__(self, collective: Collective, index: int) -> None:
        self._collective, self._index = collective, index

    def wait(self) -> None:
        assert self._index in self._collective.done, "waited on an all-reduce some rank never joined"


class Collective:
    """All-reduce MAX across ``size`` simulated ranks, in the order each rank starts them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.contributions: dict[int, list[torch.Tensor]] = {}
        self.started: dict[int, int] = {r: 0 for r in range(size)}
        self.done: set[int] = set()

    def for_rank(self, rank: int):
        def all_reduce(flag: torch.Tensor) -> _Work:
            index = self.started[rank]
            self.started[rank] += 1
            tensors = self.contributions.setdefault(index, [])
            tensors.append(flag)
            if len(tensors) == self.size:
                result = torch.stack(tensors).max(dim=0).values
                for t in tensors:
                    t.copy_(result)
                self.done.add(index)
            return _Work(self, index)

        return all_reduce


class Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now


def ranks(size: int, seconds_per_call: list[float], generation: int = 1):
    collective = Collective(size)
    clocks = [Clock(s) for s in seconds_per_call]
    checks = [HostCheck(3, generation, torch.device("cpu"), collective.for_rank(r), clocks[r]) for r in range(size)]
    return collective, clocks, checks


def call_all(checks: list[HostCheck], clocks: list[Clock], seen: list[int]) -> list[bool]:
    """One call on every rank (clocks advanced first); which ranks raised."""
    raised = []
    for check, clock, generation in zip(checks, clocks, seen):
        clock.now += clock.step
        try:
            check.check(generation)
            raised.append(False)
        except HostsUpdatedInterrupt:
            raised.append(True)
    return raised


def test_a_change_seen_by_one_rank_is_raised_by_every_rank_at_the_same_call() -> None:
    collective, clocks, checks = ranks(3, [0.001, 0.002, 0.0015])
    for call in range(1, 400):
        seen = [1, 1, 2] if call >= 250 else [1, 1, 1]  # only rank 2's heartbeat saw generation 2
        raised = call_all(checks, clocks, seen)
        assert len(set(raised)) == 1, f"call {call}: ranks disagree: {raised}"
        if raised[0]:
            break
    else:
        pytest.fail("the change was never raised")
    assert 250 < call <= 250 + 2 * MAX_CALLS_APART + 2, call  # two collectives after it was seen
    assert len(set(collective.started.values())) == 1  # every rank did the same collectives


def test_fast_calls_share_collectives_spaced_for_the_rank_that_calls_less_often() -> None:
    collective, clocks, checks = ranks(2, [0.01, 0.02])  # 10 and 5 calls per period
    for _ in range(1000):
        assert call_all(checks, clocks, [1, 1]) == [False, False]
        assert checks[0].collectives_due_at == checks[1].collectives_due_at
    # After the first two (one call apart), 5 calls apart: the rank that calls less often sets it.
    assert 198 <= collective.started[0] <= 206, collective.started[0]  # 1000 / 5, and the ramp up


def test_very_fast_calls_are_capped_at_max_calls_apart() -> None:
    collective, clocks, checks = ranks(2, [0.0001, 0.0001])
    for _ in range(1000):
        call_all(checks, clocks, [1, 1])
    assert 1000 // MAX_CALLS_APART <= collective.started[0] <= 1000 // MAX_CALLS_APART + 8  # and the ramp up


def test_slow_calls_do_a_collective_at_every_call() -> None:
    collective, clocks, checks = ranks(2, [0.5, 0.5])
    for _ in range(20):
        call_all(checks, clocks, [1, 1])
    assert collective.started == {0: 20, 1: 20}


def test_a_change_is_raised_at_the_next_but_one_call_when_calls_are_slow() -> None:
    _, clocks, checks = ranks(2, [0.5, 0.5])
    call_all(checks, clocks, [1, 1])
    assert call_all(checks, clocks, [2, 1]) == [False, False]  # its collective starts here
    assert call_all(checks, clocks, [2, 2]) == [True, True]  # and is read here


def _real_ranks(rank: int, worker: FakeWorker) -> list[int]:
    """Real gloo: rank 1 sees generation 2 from call 30 on; the call each rank raised at."""
    check = HostCheck(1, 1, torch.device("cpu"))
    for call in range(1, 2000):
        try:
            check.check(2 if rank == 1 and call >= 30 else 1)
        except HostsUpdatedInterrupt:
            return [call]
    return [-1]


def test_real_gloo_ranks_raise_at_the_same_call() -> None:
    results = run_ranks(2, _real_ranks)
    assert results[0] == results[1] and results[0][0] > 30, results


def test_a_burst_of_calls_does_not_space_out_slow_calls() -> None:
    """Two commits at an epoch's end, then steps 0.5 s apart: a change is still raised soon."""
    collective, clocks, checks = ranks(2, [0.5, 0.5])
    bursts = {5, 6}  # calls that come a millisecond after the one before
    for call in range(1, 60):
        for clock in clocks:
            clock.step = 0.001 if call in bursts else 0.5
        raised = call_all(checks, clocks, [2, 2] if call >= 8 else [1, 1])
        if raised[0]:
            break
    assert call <= 8 + 2 * 2 + 1, call  # not 20 slow calls later


def test_settle_waits_for_the_collective_in_flight_and_drops_it() -> None:
    collective, clocks, checks = ranks(2, [1.0, 1.0])
    call_all(checks, clocks, [1, 1])  # both ranks start one all-reduce
    waited = []
    checks[0].settle(waited.append)
    assert len(waited) == 1
    checks[0].settle(waited.append)  # nothing left in flight
    assert len(waited) == 1
