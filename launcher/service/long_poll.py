"""Long polls without a thread each: a request that waits for the driver's state to change.

A worker's rendezvous, heartbeat or round-lost request is answered when its answer changes
or its wait is over. At thousands of workers a thread (or a ``threading.Condition``
waiter) per pending request is the driver's whole cost, so a waiting request is a
``LongPoll``: a function that answers it from the shared state (under that state's lock),
and a ``Signal`` fired by whatever may change that answer. The rendezvous service awaits a
poll on its event loop (an ``asyncio`` future per pending request, resolved in batches);
tests and other threads may block on one (``LongPoll.wait``).

A signal is fired with the state's lock held, so a change can never fall between a poll's
last look at the state and its subscription.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")

Waker = Callable[[], None]


class Signal:
    """Whoever waits for one thing to change; ``fire`` wakes each of them once.

    Call every method with the owning state's lock held.
    """

    __slots__ = ("_wakers",)

    def __init__(self) -> None:
        self._wakers: set[Waker] = set()

    def subscribe(self, waker: Waker) -> None:
        self._wakers.add(waker)

    def unsubscribe(self, waker: Waker) -> None:
        """A waiter whose wait ended otherwise (most long polls simply time out)."""
        self._wakers.discard(waker)

    @property
    def waiting(self) -> bool:
        return bool(self._wakers)

    def fire(self) -> None:
        wakers, self._wakers = self._wakers, set()
        for wake in wakers:
            wake()


class LoopWaker:
    """Resolves futures of one event loop from any thread, many per loop iteration.

    ``call_soon_threadsafe`` writes to the loop's wake-up pipe on every call: a host change
    that wakes 4,096 heartbeats would write it 4,096 times. Here the first wake of a batch
    schedules one drain and the rest only append.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future[None]] = []

    def waker(self, future: asyncio.Future[None]) -> Waker:
        return lambda: self._wake(future)

    def _wake(self, future: asyncio.Future[None]) -> None:
        with self._lock:
            self._pending.append(future)
            first = len(self._pending) == 1
        if first:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            if not future.done():
                future.set_result(None)


@dataclasses.dataclass
class LongPoll(Generic[R]):
    """A pending request: ``answer(final)`` gives its reply, or None to go on waiting.

    ``answer`` and ``finish`` run with ``lock`` held; ``answer(True)`` (the wait is over)
    must give a reply, or move ``deadline`` later: a wait that learns at its end that it must
    cover one more fact (a round-lost question with a silent peer), bounded by the answer
    itself. ``finish`` runs once, after the reply is chosen. ``signal`` is the
    one to wait on, or a function giving the one to wait on next (e.g. the next of several
    keys still missing).
    """

    lock: threading.RLock | threading.Lock
    answer: Callable[[bool], R | None]
    signal: Signal | Callable[[], Signal]
    deadline: float
    clock: Callable[[], float]
    finish: Callable[[], None] = lambda: None
    _finished: bool = dataclasses.field(default=False, init=False)

    def _signal(self) -> Signal:
        return self.signal if isinstance(self.signal, Signal) else self.signal()

    def _try(self) -> R | None:
        deadline = self.deadline
        final = self.clock() >= deadline
        reply = self.answer(final)
        if reply is not None:
            self._finish()
        elif final and self.deadline <= deadline:
            # A bug of the answer: waiting on would spin (or hold the request for ever).
            raise RuntimeError("a long poll's answer gave no reply at its deadline and did not extend it")
        return reply

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.finish()

    def answer_now(self) -> R | None:
        """The reply if it is already known (most polls): no future, no task."""
        with self.lock:
            return self._try()

    def wait(self) -> R:
        """Block this thread until the reply is known."""
        while True:
            woken = threading.Event()
            with self.lock:
                reply = self._try()
                if reply is not None:
                    return reply
                signal = self._signal()
                signal.subscribe(woken.set)
            woken.wait(max(0.0, self.deadline - self.clock()))
            with self.lock:
                signal.unsubscribe(woken.set)

    async def wait_async(self, waker: LoopWaker) -> R:
        """Await the reply on the running event loop: no thread is held while it waits.

        Cancelled (its connection closed), it still runs ``finish``.
        """
        loop = asyncio.get_running_loop()
        try:
            while True:
                future: asyncio.Future[None] = loop.create_future()
                with self.lock:
                    reply = self._try()
                    if reply is not None:
                        return reply
                    wake = waker.waker(future)
                    signal = self._signal()
                    signal.subscribe(wake)
                timer = loop.call_later(max(0.0, self.deadline - self.clock()), _resolve, future)
                try:
                    await future
                finally:
                    timer.cancel()
                    with self.lock:
                        signal.unsubscribe(wake)
        finally:
            with self.lock:
                self._finish()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
