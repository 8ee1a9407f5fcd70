"""The driver starts worker processes with the registry's lock released: the rendezvous
service (which needs that lock for every request) answers heartbeats while it spawns."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lightning_elastic.launcher.config import LaunchConfig, Timeouts
from lightning_elastic.launcher.hosts.discovery import FixedHosts
from lightning_elastic.launcher.driver import driver as loop
from lightning_elastic.launcher.driver.driver import Driver
from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.processes.base import WorkerSpec

pytestmark = pytest.mark.timeout(60)


class LockProbingLauncher:
    """Records, for every start, whether another thread could take the registry's lock;
    the last start fails, which ends the job at once (a command that cannot run)."""

    def __init__(self) -> None:
        self.driver: Driver | None = None
        self.lock_free: list[bool] = []

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]):
        assert self.driver is not None
        lock = self.driver._registry.cond  # noqa: SLF001 - the lock under test
        took: list[bool] = []

        def probe() -> None:
            got = lock.acquire(timeout=2.0)
            took.append(got)
            if got:
                lock.release()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        self.lock_free.append(took == [True])
        raise StartError("COMMAND: x: no such program on PATH")


def test_worker_processes_are_started_with_the_registry_lock_released() -> None:
    hosts = (HostSlots("localhost", 2),)
    config = LaunchConfig(command=("x",), np=2, min_np=2, max_np=2, hosts=hosts)
    launcher = LockProbingLauncher()
    driver = Driver(config, FixedHosts(hosts), launcher, is_local=lambda _host: True)
    launcher.driver = driver
    result = driver.run()
    assert launcher.lock_free == [True]  # the first start fails: the second is never tried
    assert not result.success and result.reason == "COMMAND: x: no such program on PATH"
    assert result.refused  # nothing ran: one line, exit status 2


class IdleProcess:
    """A started worker that runs until signalled (it never asks the driver anything)."""

    pid = 4242
    child_pid = None

    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def signal(self, sig: int) -> None:
        self.code = -sig

    def wait(self, timeout: float) -> int | None:
        return self.code

    def finish_output(self, timeout: float = 5.0) -> None:
        pass

    def exit_detail(self) -> str:
        return ""

    def last_line(self) -> str:
        return ""


class ChangeDuringStartLauncher:
    """While the driver starts a worker (its lock released), a request changes something."""

    def __init__(self) -> None:
        self.driver: Driver | None = None

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]):
        assert self.driver is not None
        with self.driver._registry.cond:  # noqa: SLF001 - what a request handler does
            self.driver._registry.note_change()  # noqa: SLF001
        return IdleProcess()


def test_a_change_made_while_workers_start_is_decided_on_at_once_not_a_tick_later(monkeypatch) -> None:
    # The change's wake-up went to nobody (the loop was starting workers, not waiting): the
    # loop must see it before it waits. A fault's survivors coming back while the driver
    # started a replacement waited a whole tick for their round (50 ms of ~100 ms).
    hosts = (HostSlots("localhost", 1),)
    # A tick of 3 s: a wait for it shows plainly in the time between the two passes.
    config = LaunchConfig(command=("x",), np=1, min_np=1, max_np=1, hosts=hosts,
                          timeouts=Timeouts(tick=3.0, decide_every=3.0))
    launcher = ChangeDuringStartLauncher()
    driver = Driver(config, FixedHosts(hosts), launcher, is_local=lambda _host: True)
    launcher.driver = driver
    passes: list[float] = []
    step = loop.step

    def counted(state, turn, rules):
        result = step(state, turn, rules)
        if result.decided:
            passes.append(turn.now)
            if len(passes) == 2:
                driver.request_stop("SIGINT")
        return result

    monkeypatch.setattr(loop, "step", counted)
    result = driver.run()
    assert len(passes) >= 2 and passes[1] - passes[0] < 1.5, passes
    assert not result.success


class PreparingLauncher:
    """A launcher that keeps fork servers (``--preload``): records what it is asked, and
    stops the job once the workers started and the spare's server was prepared."""

    def __init__(self) -> None:
        self.driver: Driver | None = None
        self.events: list[tuple[str, str]] = []

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]):
        self.events.append(("start", spec.host))
        return IdleProcess()

    def prepare(self, spec: WorkerSpec) -> None:
        assert self.driver is not None
        assert not self.driver._registry.cond._is_owned()  # noqa: SLF001 - the lock is released meanwhile
        assert "RANK" not in spec.env and spec.command == ("python", "t.py")  # the job's, no worker's own
        self.events.append(("prepare", spec.host))
        self.driver.request_stop("SIGINT")


def test_with_preload_every_listed_host_gets_its_fork_server_after_the_workers_start() -> None:
    hosts = (HostSlots("h1", 1), HostSlots("h2", 1), HostSlots("spare", 1))
    config = LaunchConfig(command=("python", "t.py"), np=2, min_np=1, max_np=2, hosts=hosts, preload=("torch",))
    launcher = PreparingLauncher()
    driver = Driver(config, FixedHosts(hosts), launcher, is_local=lambda _host: True)
    launcher.driver = driver
    driver.run()
    # The workers first; then every listed host, the spare included (the launcher dedups
    # machines that already have one), each once.
    assert launcher.events[:2] == [("start", "h1"), ("start", "h2")]
    assert sorted(launcher.events[2:]) == [("prepare", "h1"), ("prepare", "h2"), ("prepare", "spare")]
