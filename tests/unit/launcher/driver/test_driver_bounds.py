"""The driver's bounds: on a worker that went quiet (the heartbeat timeout while it trains,
--exit-timeout once it has reported how training ended: it stops heartbeating to exit), and
on what it remembers for a job of weeks."""

from __future__ import annotations

import signal

import pytest

from lightning_elastic import protocol as p
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
    assert "no heartbeat for 4 s" in driver._registry.state.workers["b"].kill_reason  # noqa: SLF001

    clock.now += 21.0  # 31 s after its report: past --exit-timeout
    with driver._registry.cond:  # noqa: SLF001
        driver._kill_wedged(clock.now)  # noqa: SLF001
    assert processes["a"].code == -signal.SIGKILL
    assert driver._registry.state.workers["a"].kill_reason == "it reported done but did not exit within 30 s"  # noqa: SLF001


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


def test_the_drivers_own_absence_is_no_workers_silence() -> None:
    # Stopped (Ctrl-Z, a suspended machine) for longer than the heartbeat timeout: when it
    # runs again, the heartbeats waiting for it have not been read yet.
    clock = Clock()
    driver, processes = driver_with_two_workers(clock)
    absences = driver._absences  # noqa: SLF001 - the loop turns it every tick
    registry = driver._registry  # noqa: SLF001
    for _ in range(20):  # a second of turns, the workers' heartbeats at its start
        clock.now += 0.05
        absences.turn(clock.now)
    clock.now += 15.0  # stopped
    absences.turn(clock.now)
    with registry.cond:
        driver._kill_wedged(clock.now)  # noqa: SLF001
    assert processes["a"].code is None and processes["b"].code is None
    for turn in range(1, int(4.1 / 0.05) + 1):  # running again, past the timeout
        clock.now += 0.05
        absences.turn(clock.now)
        if turn % 20 == 0:
            registry.state.workers["a"].last_heartbeat = clock.now  # a heartbeats every second; b never again
    with registry.cond:
        driver._kill_wedged(clock.now)  # noqa: SLF001
    assert processes["a"].code is None
    assert processes["b"].code == -signal.SIGKILL


def test_absences_count_only_gaps_longer_than_the_limit() -> None:
    absences = Absences.starting(0.0, longer_than=1.0)
    absences.turn(0.9)
    absences.turn(1.8)
    assert absences.back_at == 0.0 and absences.silent_for(0.5, 1.8) == pytest.approx(1.3)
    absences.turn(3.0)  # 1.2 s without a turn
    assert absences.back_at == 3.0
    assert absences.silent_for(0.5, 3.5) == pytest.approx(0.5)  # counted from the driver's return
    assert absences.silent_for(3.2, 3.5) == pytest.approx(0.3)  # a later heartbeat counts from itself
