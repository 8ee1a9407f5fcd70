"""``lightning-elastic launch ... | head``: the driver outlives the reader of its stdout.

Once ``head`` has its lines and exits, every write to the driver's stdout fails with EPIPE.
The driver must keep draining the workers' output (else a worker blocks on a full pipe
while its heartbeats say it is fine), keep writing ``--log-dir``, and end with the job's own
exit status and verdict (not Python's 120 for a failed flush at exit). With ``2>&1`` its
stderr is gone too; the exit status must still be the job's.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO

import pytest

from tests.integration.harness import LAUNCHER, processes_running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LINES = 3000  # of 200 characters: 600 KB per worker, far more than a pipe holds
HEAD = 5  # lines read before closing the read end, like ``| head -n 5``
BOUND = 120.0  # seconds for the whole job

WORKER = textwrap.dedent(f"""
    import lightning_elastic as le

    le.init()
    state = le.ObjectState(i=0)

    @le.run
    def train(state):
        for _ in range({LINES}):
            print("x" * 200, flush=True)
        return 0

    train(state)
""")


def read_lines(fd: int, count: int, timeout: float) -> list[bytes]:
    """The first ``count`` lines from ``fd`` (fewer at EOF); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while data.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"fewer than {count} lines on the driver's stdout within {timeout} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.splitlines(keepends=True)[:count]


def kill_leftovers(marker: str) -> list[int]:
    """Pids of workers still running after a bounded wait for exits in flight; killed."""
    try:
        wait_for(lambda: not processes_running(marker), 15, "the workers to exit")
        return []
    except AssertionError:
        stray = processes_running(marker)
        for proc in stray:
            proc.kill()
        return [proc.pid for proc in stray]


def run_like_head(tmp_path: Path, stderr: int | IO[bytes]) -> tuple[int, list[bytes], list[int]]:
    """Launch the chatty job, read HEAD lines of its stdout and close it, like ``| head -n 5``.

    Returns the driver's exit status, the lines read and the pids of workers left running.
    """
    script = tmp_path / "chatty_worker.py"
    script.write_text(WORKER)
    env = dict(os.environ)
    env.pop("LIGHTNING_ELASTIC_DRIVER_URL", None)
    # As a user runs it: stdout block-buffered, so a failed flush leaves text behind to fail again.
    env.pop("PYTHONUNBUFFERED", None)
    driver = subprocess.Popen(
        [str(LAUNCHER), "launch", "-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "--log-dir", str(tmp_path / "logs"),
         sys.executable, str(script)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=stderr, bufsize=0,
    )
    try:
        assert driver.stdout is not None
        first = read_lines(driver.stdout.fileno(), HEAD, BOUND)
        driver.stdout.close()  # the reader is gone: the driver's next writes get EPIPE
        try:
            code = driver.wait(BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver did not end within {BOUND} s after its stdout closed") from None
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        stray = kill_leftovers(str(script))
    return code, first, stray


def assert_logs_complete(tmp_path: Path) -> None:
    """Every line of both workers is in its --log-dir file: they were drained to the end."""
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert len(logs) == 2, logs
    for path in logs:
        assert path.read_text().count("x" * 200 + "\n") == LINES, path


def test_job_succeeds_after_the_stdout_reader_goes_away(tmp_path: Path) -> None:
    """``| head -n 5``: exit 0, "job succeeded" last on stderr, one warning, full logs, no worker left."""
    stderr_path = tmp_path / "driver.err"
    with open(stderr_path, "wb") as stderr:
        try:
            code, first, stray = run_like_head(tmp_path, stderr)
        finally:
            err = stderr_path.read_text(errors="replace")
            print(err[-3000:])  # shown by pytest when the test fails
    assert len(first) == HEAD and all(line.endswith(b"x" * 200 + b"\n") for line in first), first
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 0
    assert "job succeeded" in lines[-1]
    assert "Exception ignored" not in err and "Traceback" not in err
    assert err.count("Driver output <stdout> is closed (Broken pipe)") == 1  # said once, for both workers
    assert_logs_complete(tmp_path)
    assert not stray, f"workers left running after the driver exited: {stray}"


def test_job_status_survives_stdout_and_stderr_going_away(tmp_path: Path) -> None:
    """``2>&1 | head -n 5``: the verdict has nowhere to go, but the exit status is still the job's."""
    code, first, stray = run_like_head(tmp_path, subprocess.STDOUT)
    assert len(first) == HEAD, first
    assert code == 0
    assert_logs_complete(tmp_path)
    assert not stray, f"workers left running after the driver exited: {stray}"
