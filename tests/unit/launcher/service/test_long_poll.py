"""launcher/service/long_poll.py: requests that wait on an event loop, not on a thread each."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from lightning_elastic.launcher.service.long_poll import LongPoll, LoopWaker, Signal

pytestmark = pytest.mark.timeout(30)


class Box:
    """Shared state guarded by ``lock``: a value polls wait for."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.value: str | None = None
        self.changed = Signal()
        self.finished = 0

    def set(self, value: str) -> None:
        with self.lock:
            self.value = value
            self.changed.fire()

    def poll(self, seconds: float) -> LongPoll[str]:
        def answer(final: bool) -> str | None:
            return self.value if self.value is not None else ("timeout" if final else None)

        def finish() -> None:
            self.finished += 1

        return LongPoll(self.lock, answer, self.changed, time.monotonic() + seconds, time.monotonic, finish)


def test_a_blocking_wait_is_answered_when_the_state_changes():
    box = Box()
    timer = threading.Timer(0.05, box.set, ("ready",))
    timer.start()
    assert box.poll(10.0).wait() == "ready"
    timer.join()
    assert box.finished == 1 and not box.changed.waiting


def test_a_wait_that_runs_out_is_answered_finally_and_leaves_no_subscriber():
    box = Box()
    assert box.poll(0.05).wait() == "timeout"
    assert box.finished == 1 and not box.changed.waiting


def extended_once(box: Box) -> tuple[LongPoll[str], list[bool]]:
    """A poll whose answer, at its first deadline, waits once more (bounded) instead."""
    finals: list[bool] = []

    def answer(final: bool) -> str | None:
        finals.append(final)
        if final and finals.count(True) == 1:
            poll.deadline = time.monotonic() + 0.05  # one more, bounded, wait
            return None
        return "bounded" if final else None

    poll = LongPoll(box.lock, answer, box.changed, time.monotonic() + 0.05, time.monotonic)
    return poll, finals


def test_an_answer_may_move_the_deadline_later_instead_of_replying_at_it():
    # A round-lost question whose --error-wait ran out with a peer silent waits on, bounded.
    poll, finals = extended_once(Box())
    assert poll.wait() == "bounded"
    assert finals.count(True) == 2


def test_an_async_wait_follows_a_deadline_its_answer_moved():
    box = Box()
    poll, finals = extended_once(box)

    async def main() -> str:
        return await asyncio.wait_for(poll.wait_async(LoopWaker(asyncio.get_running_loop())), 10)

    assert asyncio.run(main()) == "bounded"
    assert finals.count(True) == 2 and not box.changed.waiting


def test_an_answer_that_neither_replies_nor_moves_the_deadline_is_a_bug_not_a_spin():
    box = Box()
    poll = LongPoll(box.lock, lambda final: None, box.changed, time.monotonic(), time.monotonic)
    with pytest.raises(RuntimeError, match="did not extend it"):
        poll.wait()


def test_thousands_of_async_waits_share_one_thread_and_wake_on_one_fire():
    box = Box()

    async def main() -> list[str]:
        waker = LoopWaker(asyncio.get_running_loop())
        waits = [asyncio.ensure_future(box.poll(10.0).wait_async(waker)) for _ in range(2000)]
        await asyncio.sleep(0.05)
        threads = threading.active_count()
        threading.Thread(target=box.set, args=("go",)).start()  # fired from another thread
        done = await asyncio.wait_for(asyncio.gather(*waits), 10)
        assert threading.active_count() <= threads + 1
        return done

    assert asyncio.run(main()) == ["go"] * 2000
    assert box.finished == 2000 and not box.changed.waiting


def test_an_async_wait_times_out_on_its_deadline_and_unsubscribes():
    box = Box()

    async def main() -> str:
        return await box.poll(0.05).wait_async(LoopWaker(asyncio.get_running_loop()))

    assert asyncio.run(main()) == "timeout"
    assert box.finished == 1 and not box.changed.waiting


def test_a_cancelled_async_wait_still_finishes_and_unsubscribes():
    # The connection of a pending long poll closed: its bookkeeping must not linger
    # (a round-lost request counts its worker as asking until it finishes).
    box = Box()

    async def main() -> None:
        task = asyncio.ensure_future(box.poll(10.0).wait_async(LoopWaker(asyncio.get_running_loop())))
        await asyncio.sleep(0.05)
        assert box.changed.waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert box.finished == 1 and not box.changed.waiting


def test_the_loop_waker_schedules_one_drain_for_a_burst_of_wakes():
    async def main() -> int:
        loop = asyncio.get_running_loop()
        scheduled = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal scheduled
            scheduled += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        waker = LoopWaker(loop)
        futures = [loop.create_future() for _ in range(500)]
        for future in futures:
            waker.waker(future)()
        await asyncio.wait_for(asyncio.gather(*futures), 5)
        return scheduled

    assert asyncio.run(main()) == 1
