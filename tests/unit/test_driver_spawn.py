"""The driver starts worker processes with the registry's lock released: the rendezvous
service (which needs that lock for every request) answers heartbeats while it spawns."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lightning_elastic.launcher.config import LaunchConfig
from lightning_elastic.launcher.discovery import FixedHosts
from lightning_elastic.launcher.driver import Driver
from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.hosts import HostSlots
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
