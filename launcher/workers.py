"""Starting and stopping worker processes on this machine, with their output prefixed.

Each worker runs in its own session (process group), so stopping it also stops any
processes it started (data-loader workers), and it gets SIGKILL if the driver dies
(PR_SET_PDEATHSIG), so no worker outlives the driver even when the driver is SIGKILLed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the driver's own shutdown path still stops workers


class LocalProcess:
    """One worker process; ``prefix()`` is read for every output line, so it can change."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        prefix: Callable[[], str],
        log_file: Path | None,
        out: IO[str] | None = None,
    ) -> None:
        self._prefix = prefix
        self._out = out or sys.stdout
        self._log = open(log_file, "a", buffering=1) if log_file else None  # noqa: SIM115
        self._proc = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._reader = threading.Thread(target=self._forward, name=f"output-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int | None:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def finish_output(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until all output of the exited process has been forwarded."""
        self._reader.join(timeout)

    def _forward(self) -> None:
        assert self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            self._out.write(f"{self._prefix()}{line}")
            self._out.flush()
            if self._log:
                self._log.write(line)
        if self._log:
            self._log.close()


def stop_all(processes: Sequence[LocalProcess], grace: float) -> None:
    """SIGTERM every process, then SIGKILL those still running after ``grace`` seconds.

    SIGTERM first lets a worker clean up (close files, leave its process group); SIGKILL
    after a bound because a hung or SIGSTOPped worker would never act on SIGTERM.
    """
    running = [p for p in processes if p.poll() is None]
    for p in running:
        p.signal(signal.SIGTERM)
        p.signal(signal.SIGCONT)  # a stopped process only sees SIGTERM once continued
    for p in running:
        if p.wait(grace) is None:
            log.warning("Worker process %d ignored SIGTERM for %.0f s: killing it.", p.pid, grace)
            p.signal(signal.SIGKILL)
            p.wait(grace)
    for p in processes:
        p.finish_output()
