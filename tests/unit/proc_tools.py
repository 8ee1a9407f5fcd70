"""Helpers for the unit tests that start real (short-lived, local) processes.

Every wait here is bounded: a test that would hang fails with an assertion instead.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import IO

import psutil

REPO = Path(__file__).resolve().parents[2]
BOUND = 5.0  # seconds: generous for a python start on a loaded 2-core machine


class LineReader:
    """Reads a binary stream's lines in a thread, so a test can wait for one with a bound."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        except (OSError, ValueError):
            pass
        self._lines.put(None)  # EOF

    def next(self, timeout: float = BOUND) -> str | None:
        """The next line, or None at EOF; fails the test after ``timeout`` seconds."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s") from None

    def rest(self, timeout: float = BOUND) -> list[str]:
        """Every remaining line up to EOF (the stream's writers all closed it)."""
        deadline = time.monotonic() + timeout
        lines = []
        while (line := self.next(max(0.0, deadline - time.monotonic()))) is not None:
            lines.append(line)
        return lines


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan's may wait for a slow init to reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float = BOUND) -> bool:
    deadline = time.monotonic() + timeout
    while not is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill_quietly(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass
