"""The driver's bounds: on a worker that went quiet (the heartbeat timeout while it trains,
--exit-timeout once it has reported how training ended: it stops heartbeating to exit), and
on what it remembers for a job of weeks."""

from __future__ import annotations

import signal

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.config import LaunchConfig, Timeouts
from lightning_elastic.launcher.discovery import FixedHosts
from lightning_elastic.launcher.driver import REFUSED_HOSTS_KEPT, Driver
from lightning_elastic.launcher.hosts import HostSlots, SlotKey
from tests.unit.test_driver_spawn import IdleProcess

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


def test_a_worker_that_reported_the_end_of_training_is_given_the_exit_timeout_not_the_heartbeat_timeout() -> None:
    # Its exit (the last host check, the group's teardown, the interpreter's end) sends no
    # heartbeat and takes seconds on a busy machine: CI once saw finished workers SIGKILLed
    # for "no heartbeat for 4 s" while they exited.
    clock = Clock()
    driver, processes = driver_with_two_workers(clock)
    driver._registry.report(p.Report("a", 1, p.Outcome.DONE))  # noqa: SLF001
    clock.now += 10.0  # both silent for more than the heartbeat timeout
    with driver._registry.cond:  # noqa: SLF001
        driver._kill_wedged(clock.now)  # noqa: SLF001
    assert processes["a"].code is None  # reported: exiting, not wedged
    assert processes["b"].code == -signal.SIGKILL  # still training and silent: wedged
    assert "no heartbeat for 4 s" in driver._kill_reasons["b"]  # noqa: SLF001

    clock.now += 21.0  # 31 s after its report: past --exit-timeout
    with driver._registry.cond:  # noqa: SLF001
        driver._kill_wedged(clock.now)  # noqa: SLF001
    assert processes["a"].code == -signal.SIGKILL
    assert driver._kill_reasons["a"] == "it reported done but did not exit within 30 s"  # noqa: SLF001


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
