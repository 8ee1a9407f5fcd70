"""Forwarding a worker's output to the driver's stdout, each line prefixed with its rank.

A thread per stream reads lines and writes them prefixed; ``prefix()`` is read per line
because a worker's rank changes from round to round. With ``--log-dir`` the raw lines
also go to the worker's own log file.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO


class LineForwarder:
    def __init__(
        self, stream: IO[bytes], prefix: Callable[[], str], log_file: Path | None, out: IO[str] | None, name: str
    ) -> None:
        self._stream = stream
        self._prefix = prefix
        self._out = out or sys.stdout
        self._log = open(log_file, "a", buffering=1) if log_file else None  # noqa: SIM115
        self._thread = threading.Thread(target=self._forward, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _forward(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode(errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                self._out.write(f"{self._prefix()}{line}")
                self._out.flush()
                if self._log:
                    self._log.write(line)
        finally:
            if self._log:
                self._log.close()
