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

The notice is acted on by a thread of its own, not by a Python signal handler: Python runs
handlers in the main thread only, between two bytecodes, so a main thread blocked in a
collective (gloo or NCCL waiting for a peer, minutes to the collective timeout) would never
ask to leave nor start the grace, and the worker would be SIGKILLed at the end of the
platform's grace with nothing said. Python's C-level signal handler, which runs at once
whatever the main thread does, writes the signal's number to a wakeup descriptor
(``signal.set_wakeup_fd``); the watcher thread reads it and acts. The Python-level handler
installed for SIGTERM does nothing but keep SIGTERM's default action (death) away.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
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
        # Held while deciding to die and while marking the departure. Re-entrant: with the
        # Python-handler fallback, the handler may run in the main thread inside left().
        self._leaving = threading.RLock()
        self.watchdog: threading.Thread | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None

    def install(self) -> None:
        """Become the SIGTERM handler (main thread only, as Python requires) and start the
        thread that acts on it."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C handler must never block
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread after all
            reader.close()
            writer.close()
            raise
        if previous != -1:
            # Someone else's wakeup descriptor (an asyncio loop in the main thread): keep it
            # and act from the Python handler, as before (a blocked main thread delays it).
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            signal.signal(signal.SIGTERM, self.handle)
            return
        self._wakeup = (reader, writer)  # kept open for the life of the process
        signal.signal(signal.SIGTERM, self._noted)
        os.register_at_fork(after_in_child=self._forked)
        threading.Thread(target=self._watch, args=(reader,), name="elastic-preemption", daemon=True).start()

    @staticmethod
    def is_installed() -> bool:
        handler = signal.getsignal(signal.SIGTERM)
        return isinstance(getattr(handler, "__self__", None), PreemptionHandler)

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): SIGTERM is its plain self again. Else it
        would write to this process's wakeup descriptor (its SIGTERM taken for a second
        one here) and ignore SIGTERM itself (the no-op handler)."""
        if signal.getsignal(signal.SIGTERM) != self._noted:
            return
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the child's main thread: nothing to undo from here
            pass

    def _noted(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: the watcher thread has acted already (or will), unless
        something replaced the wakeup descriptor since (an asyncio loop started later in the
        main thread): then the notice is acted on here, as before."""
        ours = self._wakeup[1].fileno() if self._wakeup is not None else -2
        current = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(current, warn_on_full_buffer=current != ours)
        if current != ours:
            self.handle(signum, frame)

    def _watch(self, reader: socket.socket) -> None:
        while True:
            try:
                received = reader.recv(64)
            except OSError:
                return
            if not received:
                return
            # One byte per signal with a Python handler (SIGINT's too): act on SIGTERM's only.
            for number in received:
                if number == signal.SIGTERM:
                    self.handle(signal.SIGTERM, None)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the watcher thread (or, with another wakeup descriptor in place, in the
        # main thread between two bytecodes); a request to the driver takes milliseconds
        # (a separate client: the main thread may be mid-request).
        if self._gone.is_set():
            _say("SIGTERM received while this worker is leaving the job: it goes on leaving")
            return
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
        with self._leaving:
            if self._gone.is_set():
                # The worker began leaving on its own meanwhile (told to exit at the
                # rendezvous): dying now would turn that clean departure into a failure.
                _say(f"{why} while this worker is leaving the job: it goes on leaving")
                return
            _say(f"{why}: exiting now")
            self._die()

    def left(self) -> None:
        """The worker is leaving (before it reports so): a SIGTERM from now on, and the grace
        watchdog, leave it to finish. Exclusive with dying: a SIGTERM acted on by the watcher
        thread either ends the process before this returns or sees it set."""
        with self._leaving:
            self._gone.set()


def _die_by_sigterm() -> None:
    """The plain SIGTERM behaviour: die by the signal (the exit status says so).

    From any thread: Python lets only the main thread change a signal's action, so the
    default action is restored through libc's ``signal``; where that is not possible, exit
    with the status a death by SIGTERM gives in a shell.
    """
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        else:
            libc_signal = ctypes.CDLL(None).signal
            libc_signal.restype = ctypes.c_void_p
            libc_signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            if libc_signal(int(signal.SIGTERM), None) == ctypes.c_void_p(-1).value:  # SIG_DFL is 0
                raise OSError("signal() failed")
        # To this thread: delivered before the call returns (a process-directed kill from a
        # thread other than the main one may be delivered a little later).
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    os._exit(128 + signal.SIGTERM)


def _say(message: str) -> None:
    print(f"lightning-elastic: {message}", file=sys.stderr, flush=True)
