"""launcher/processes/base.py ``stop_all``: one grace for every worker, not one each."""

from __future__ import annotations

import signal

import pytest

from lightning_elastic.launcher.processes import base
from lightning_elastic.launcher.processes.base import WorkerSpec


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class HungProcess:
    """Ignores SIGTERM; SIGKILL ends it. ``wait`` moves the fake clock by what it waited."""

    def __init__(self, clock: FakeTime, pid: int) -> None:
        self.clock, self.pid = clock, pid
        self.signals: list[signal.Signals] = []
        self.waits: list[float] = []
        self.finished = False

    def poll(self) -> int | None:
        return -9 if signal.SIGKILL in self.signals else None

    def signal(self, sig: signal.Signals) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float) -> int | None:
        self.waits.append(timeout)
        if self.poll() is None:
            self.clock.now += timeout
        return self.poll()

    def finish_output(self) -> None:
        self.finished = True


def test_every_hung_worker_shares_one_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr(base, "time", clock)
    procs = [HungProcess(clock, pid) for pid in range(8)]
    base.stop_all(procs, grace=5.0)
    assert clock.now - 100.0 == 5.0  # one grace in all (was 8 x 5 s, one after another)
    assert procs[0].waits[0] == 5.0 and all(p.waits[0] == 0.0 for p in procs[1:])
    assert all(p.signals == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL] for p in procs)
    assert all(p.finished for p in procs)


def test_a_spec_never_shows_its_secret() -> None:
    spec = WorkerSpec("w", "h", ("python",), {}, secret="s3cret-value", cwd="/")
    assert "s3cret-value" not in repr(spec)
