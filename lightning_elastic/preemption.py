"""SIGTERM as a preemption notice: leave the job gracefully instead of dying mid-step.

Kubernetes, Slurm and spot instances announce a preemption with SIGTERM and kill the
process a grace period later (Kubernetes: 30 s). Dying at once would make every peer roll
back to the last commit and blacklist a healthy host. Instead the worker asks the driver to
let it leave; the driver announces the departure like a host removal, every rank stops at
the same step with its live state, and this worker is answered "exit" at the rendezvous
(exit status 0). Nothing is rolled back and the host is not blacklisted.

The fallbacks are the plain SIGTERM behaviour: a second SIGTERM, a driver that says "exit
now" (it is stopping this worker itself, or training is over) or cannot be reached, and the
grace period running out (a loop that never checks for host updates).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class PreemptionHandler:
    def __init__(
        self,
        request_leave: Callable[[str], bool],
        grace: float,
        exit_process: Callable[[int], Any] = os._exit,
        die: Callable[[], Any] | None = None,
    ) -> None:
        self._request_leave = request_leave
        self._grace = grace
        self._exit_process = exit_process  # from the grace watchdog thread
        self._die = die or _die_by_sigterm  # from the handler, in the main thread
        self._received = False
        self._gone = threading.Event()
        self.watchdog: threading.Thread | None = None

    def install(self) -> None:
        """Become the SIGTERM handler (main thread only, as Python requires)."""
        signal.signal(signal.SIGTERM, self.handle)

    @staticmethod
    def is_installed() -> bool:
        handler = signal.getsignal(signal.SIGTERM)
        return isinstance(getattr(handler, "__self__", None), PreemptionHandler)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes, so it may do I/O; a request to the
        # driver takes milliseconds (a separate client: the main thread may be mid-request).
        if self._received:
            self._terminate("a second SIGTERM")
            return
        self._received = True
        if not self._request_leave("SIGTERM (preemption notice)"):
            self._terminate("SIGTERM")
            return
        _say(f"SIGTERM received: leaving the job at the next host-update check (grace {self._grace:g} s)")
        self.watchdog = threading.Thread(target=self._expire, name="elastic-preemption-grace", daemon=True)
        self.watchdog.start()

    def _expire(self) -> None:
        if self._gone.wait(self._grace):
            return
        # Another thread cannot restore SIGTERM's default action (Python allows that in the
        # main thread only, which may be blocked in a collective): exit as a SIGTERM would.
        _say(f"the preemption grace of {self._grace:g} s ran out before this worker could leave: exiting")
        self._exit_process(128 + signal.SIGTERM)

    def _terminate(self, why: str) -> None:
        _say(f"{why}: exiting now")
        self._die()

    def left(self) -> None:
        """The worker is leaving: the grace watchdog has nothing more to do."""
        self._gone.set()


def _die_by_sigterm() -> None:
    """The plain SIGTERM behaviour: die by the signal (the exit status says so)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _say(message: str) -> None:
    print(f"lightning-elastic: {message}", file=sys.stderr, flush=True)
