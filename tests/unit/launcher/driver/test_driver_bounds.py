"""The driver's bounds on what it remembers for a job of weeks, and the absences the loop
counts (the rules that use them are tested through the step: tests/unit/launcher/job/test_step.py)."""

from __future__ import annotations


import pytest

from lightning_elastic.launcher.config import LaunchConfig, Timeouts
from lightning_elastic.launcher.hosts.discovery import FixedHosts
from lightning_elastic.launcher.driver.driver import Driver
from lightning_elastic.launcher.driver.host_intake import REFUSED_HOSTS_KEPT
from lightning_elastic.launcher.job.slots import HostSlots, SlotKey
from lightning_elastic.launcher.job.liveness import Absences
from tests.unit.launcher.driver.test_driver_spawn import IdleProcess

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def driver_with_two_workers(clock: Clock) -> tuple[Driver, dict[str, IdleProcess]]:
    hosts = (HostSlots("localhost", 2),)
    config = LaunchConfig(command=("x",), np=2, min_np=2, max_np=2, hosts=hosts,
                          timeouts=Timeouts(heartbeat_timeout=4.0, exit=30.0))
    driver = Driver(config, FixedHosts(hosts), launcher=None, is_local=lambda _host: True, clock=clock)  # type: ignore[arg-type]
    registry = driver._registry  # noqa: SLF001 - the state the verdict reads
    processes = {}
    with registry.cond:  # the driver loop's lock, as in a decision pass
        for local_rank, worker_id in enumerate(("a", "b")):
            record = registry.add_worker(worker_id, SlotKey("localhost", local_rank))
            record.joined = True
            record.last_heartbeat = clock.now
            processes[worker_id] = driver._processes[worker_id] = IdleProcess()  # noqa: SLF001
    return driver, processes


def test_the_hosts_said_to_be_ignored_are_remembered_boundedly(caplog) -> None:
    # Said once per host while remembered; a discovery listing new bad names for weeks
    # must not grow the driver's memory.
    driver, _ = driver_with_two_workers(Clock())
    for n in range(REFUSED_HOSTS_KEPT + 10):
        driver._refuse(f"bad-{n}", "its name does not resolve")  # noqa: SLF001
    driver._refuse(f"bad-{REFUSED_HOSTS_KEPT + 5}", "its name does not resolve")  # noqa: SLF001 - remembered: not said again
    assert len(driver._refused_hosts) <= REFUSED_HOSTS_KEPT  # noqa: SLF001
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignoring host")]
    assert len(said) == REFUSED_HOSTS_KEPT + 10


def test_absences_count_only_gaps_longer_than_the_limit() -> None:
    absences = Absences.starting(0.0, longer_than=1.0)
    absences.turn(0.9)
    absences.turn(1.8)
    assert absences.back_at == 0.0 and absences.silent_for(0.5, 1.8) == pytest.approx(1.3)
    absences.turn(3.0)  # 1.2 s without a turn
    assert absences.back_at == 3.0
    assert absences.silent_for(0.5, 3.5) == pytest.approx(0.5)  # counted from the driver's return
    assert absences.silent_for(3.2, 3.5) == pytest.approx(0.3)  # a later heartbeat counts from itself
