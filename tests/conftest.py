"""The suite runs in two lanes (``scripts/test.sh``: ``pytest -n 2 --dist loadgroup``).

Most of an integration test's time is waiting: for steps that sleep, for timeouts to
expire, for processes to start. Two lanes side by side use the two cores of the machine
CI runs on where one left them idle half of the time. Each test file belongs to one lane
and runs there in order, so that what a file shares (a Ray cluster, the Slurm cluster, the
namespaced ssh hosts, which a session fixture makes once) is made once, by one lane. The
lanes are balanced by the files' measured durations, and the Lightning-heavy files (whose
workers spend seconds importing) share lane "a" with the unit tests, away from the files
whose tests bound a heartbeat timeout or a start-up tightly (lane "b").
"""

from __future__ import annotations

import pytest

LANE_B = frozenset({
    "test_bad_inputs.py", "test_broken_stdout.py", "test_chaos_loop.py", "test_driver_restart.py",
    "test_elastic_launch.py", "test_fleet.py", "test_hostile.py", "test_multi_machine.py",
    "test_namespaces.py", "test_slurm.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        lane = "b" if item.path.name in LANE_B else "a"
        item.add_marker(pytest.mark.xdist_group(lane))
