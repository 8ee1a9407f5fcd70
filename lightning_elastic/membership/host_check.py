"""The host check: every rank of a round learns at the same call that the hosts changed.

Each rank knows the newest host generation its heartbeat saw; one MAX all-reduce makes that
knowledge common, so all ranks decide alike at the same call of ``check()``. The all-reduce
runs in the background between two collectives: a collective reads the result of the one
before (done by then, so no wait) and starts the next, keeping the round trip off the step.

A collective at every call is still not free (a measurable part of a small model's step:
docs/performance.md). A host change needs an answer within a
fraction of a second, not within one step, so calls that come faster than
``CHECK_PERIOD_S`` apart share one collective: each collective also carries every rank's
proposal for how many calls to skip until the next one (from its own measured call rate),
and the smallest proposal is taken. Every rank reads the same agreed number at the same
call, so every rank still does its collectives, and raises, at the same calls.

A change is acted on at most two collectives after the heartbeat saw it: about
``2 * CHECK_PERIOD_S`` when calls are frequent and steady, the next-but-one call when they
are slower than that, and never more than ``2 * MAX_CALLS_APART`` calls later.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_elastic.errors import HostsUpdatedInterrupt

# Calls closer together than this share one collective (see the module doc).
CHECK_PERIOD_S = 0.1
# Never more calls than this between two collectives, however fast the calls come. The
# spacing is agreed in calls from the rate measured before: when the calls slow down (a
# joiner importing torch on the same cores), a change waits for up to this many of the
# slow calls.
MAX_CALLS_APART = 20


def calls_until_next(elapsed_s: float, calls: int, period_s: float = CHECK_PERIOD_S,
                     max_calls: int = MAX_CALLS_APART) -> int:
    """How many calls apart the collectives should be for about ``period_s`` between them,
    given that the last ``calls`` calls (the last spacing) took ``elapsed_s`` seconds.

    At least 1; at most twice the last spacing, so that one burst of calls (two commits at
    an epoch's end) cannot space the collectives out by more than that: measured over a
    longer spacing next time, slower calls bring it back down at once.
    """
    if calls <= 0 or elapsed_s <= 0:
        return 1
    by_rate = int(period_s * calls / elapsed_s + 1e-9)  # 4.99999... is 5
    return max(1, min(max_calls, 2 * calls, by_rate))


class Work(Protocol):
    def wait(self) -> Any: ...


def all_reduce_max(flag: torch.Tensor) -> Work:
    """The collective the check uses: an asynchronous MAX all-reduce on the round's group."""
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)


@dataclasses.dataclass
class _Pending:
    flag: torch.Tensor  # [newest generation, -(calls until the next collective)] once reduced
    work: Work


class HostCheck:
    """The host check of one round (a new round gets a new one: the counts start again)."""

    def __init__(
        self, round_: int, generation: int, device: torch.device,
        all_reduce: Callable[[torch.Tensor], Work] = all_reduce_max,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[Work], object] = lambda work: work.wait(),
    ) -> None:
        """``wait``: how a pending all-reduce is waited for (the worker's ``wait_collective``,
        which gives up one of a round that lost a member instead of waiting for the group's
        timeout)."""
        self.round = round_
        self._generation = generation  # the one this round was formed at
        self._device = device
        self._all_reduce = all_reduce
        self._clock = clock
        self._wait = wait
        self._calls = 0
        self._next_collective = 1  # the call that does the next collective
        self._pending: _Pending | None = None
        self._last_collective: tuple[float, int] | None = None  # (time, call) of the last one

    @property
    def collectives_due_at(self) -> int:
        """The call number of the next collective (calls are numbered from 1 in a round)."""
        return self._next_collective

    def check(self, seen_generation: int) -> None:
        """One call: raises ``HostsUpdatedInterrupt`` on every rank at the same call."""
        self._calls += 1
        if self._calls < self._next_collective:
            return
        calls_apart = 1
        pending, self._pending = self._pending, None
        if pending is not None:
            self._wait(pending.work)
            newest, negated_calls = (int(v) for v in pending.flag.tolist())
            if newest > self._generation:
                raise HostsUpdatedInterrupt(
                    f"hosts changed (generation {newest}, round {self.round} formed at {self._generation})"
                )
            calls_apart = -negated_calls
        now = self._clock()
        proposal = 1
        if self._last_collective is not None:
            last_time, last_call = self._last_collective
            proposal = calls_until_next(now - last_time, self._calls - last_call)
        self._last_collective = (now, self._calls)
        self._next_collective = self._calls + calls_apart
        # MAX of the negated proposal is the smallest proposal: the most frequent rank wins.
        flag = torch.tensor([seen_generation, -proposal], dtype=torch.int64, device=self._device)
        self._pending = _Pending(flag, self._all_reduce(flag))

    def settle(self, wait: Callable[[Work], Any]) -> None:
        """Wait for the collective in flight, if any, and drop it (at the end of training:
        its result no longer matters, only that it is not left running)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            wait(pending.work)
