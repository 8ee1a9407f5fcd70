from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.harness import Job, wait_for


@pytest.fixture
def job(tmp_path) -> Iterator[Job]:
    """A launch in its own directory; afterwards no process of it may be left running."""
    j = Job(tmp_path)
    yield j
    j.kill()
    # The driver must have stopped every worker it started (bounded wait for exits in flight).
    try:
        wait_for(lambda: not j.stray_processes(), 15, "the job's processes to exit")
    except AssertionError:
        stray = j.stray_processes()
        for proc in stray:
            proc.kill()
        pytest.fail(f"processes left behind after the driver exited: {[p.pid for p in stray]}")
