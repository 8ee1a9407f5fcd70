"""BackgroundLineFile: appending never waits on the disk; a failing file is said once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from lightning_elastic.launcher.observe.line_file import BackgroundLineFile

pytestmark = pytest.mark.timeout(60)  # an append that blocked would hang here


def test_appends_return_while_the_file_does_not_drain_and_the_excess_is_counted(tmp_path: Path) -> None:
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never read until the end: a stalled disk
    try:
        out = BackgroundLineFile(fifo, on_failure=lambda err: None, max_pending=100)
        line = "x" * 1000 + "\n"
        for _ in range(1000):  # 1 MB: far beyond the pipe's 64 KiB and the 100 queued lines
            out.append(line)
        assert out.dropped > 0
        received = bytearray()
        os.set_blocking(reader, True)
        done = threading.Thread(target=out.close, kwargs={"timeout": 30})
        done.start()
        while chunk := os.read(reader, 1 << 16):  # EOF once the writer closed the file
            received += chunk
        done.join(30)
        assert not done.is_alive()
        assert len(received) == (1000 - out.dropped) * len(line)  # whole lines, none torn
    finally:
        os.close(reader)


def test_a_write_error_is_said_once_and_later_lines_are_dropped() -> None:
    failures: list[OSError] = []
    said = threading.Event()

    def on_failure(err: OSError) -> None:
        failures.append(err)
        said.set()

    out = BackgroundLineFile(Path("/dev/full"), on_failure)  # every write: ENOSPC
    out.append("first\n")
    assert said.wait(10)
    out.append("second\n")  # dropped without a second report
    out.close()
    assert len(failures) == 1 and "No space left" in str(failures[0])
    assert out.failed
