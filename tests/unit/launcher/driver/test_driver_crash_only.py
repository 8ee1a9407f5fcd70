"""Crash-only driver (issue 20 item 5): a bug of ours in the decision loop ends the job with a
verdict that names it, every worker stopped, never a traceback alone with workers left behind."""

from __future__ import annotations

import sys

import psutil
import pytest

from lightning_elastic.launcher.config import LaunchConfig
from lightning_elastic.launcher.hosts.discovery import FixedHosts
from lightning_elastic.launcher.driver.driver import Driver
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.processes.local import LocalLauncher

pytestmark = pytest.mark.timeout(60)

# A worker that never joins and ignores nothing: it would run for a minute unless stopped.
SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def test_an_unexpected_error_in_the_loop_is_a_verdict_with_every_worker_stopped(caplog) -> None:
    hosts = (HostSlots("localhost", 2),)
    config = LaunchConfig(command=SLEEPER, np=2, min_np=2, max_np=2, hosts=hosts)
    driver = Driver(config, FixedHosts(hosts), LocalLauncher(), is_local=lambda _host: True)
    processes = driver._processes  # noqa: SLF001 - the workers it started
    tick = driver._state.hosts.tick  # noqa: SLF001
    pids: list[int] = []

    def failing_tick():
        # Once both workers run: a bug of ours (an arithmetic error, a None where a value
        # was expected), raised in the loop with the registry's lock held.
        if len(processes) == 2:
            pids.extend(p.pid for p in processes.values())
            raise ZeroDivisionError("division by zero")
        return tick()

    driver._state.hosts.tick = failing_tick  # noqa: SLF001
    result = driver.run()
    assert not result.success
    assert result.reason.startswith("the driver failed: ZeroDivisionError: division by zero"), result.reason
    assert not result.refused  # the job ran: the summary is printed as for any other end
    assert "The driver failed; stopping every worker." in caplog.text  # with its traceback, once
    assert len(pids) == 2
    for pid in pids:  # stopped (SIGTERM within the grace), and reaped: nothing left behind
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
