"""Waking the driver the moment a worker process exits, instead of at its next tick.

The driver reaps exits by polling every ``Timeouts.tick`` (50 ms). A lost worker is on
every recovery's critical path: its survivors cannot re-form until the driver has seen it
go, and a tick adds up to 50 ms to a recovery of about 100 ms. One thread waits on a
pidfd per child (Linux 5.3 and later; readable once the process has exited and can be
reaped) and calls ``on_exit``, which wakes the driver's loop; the loop's own ``poll()``
still does the reaping, so nothing changes hands between threads but a wake-up.

Where pidfds are unavailable (an older kernel, another OS), ``watch`` says no and the tick
remains the only way exits are seen: slower, never wrong. One descriptor per live child,
closed when it exits or when the watcher closes: bounded by the number of workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ExitWatcher:
    """Calls ``on_exit()`` from its own thread whenever a watched child process exits."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._pending: list[int] = []  # pidfds to register, handed from watch() to the thread
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="exit-watcher", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> bool:
        """Watch the child ``pid``; False when this system cannot (the tick still sees it)."""
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            return False
        try:
            pidfd = pidfd_open(pid)
        except OSError:  # ENOSYS on an old kernel; ESRCH cannot happen for an unreaped child
            return False
        with self._lock:
            if self._closed:
                os.close(pidfd)
                return False
            self._pending.append(pidfd)
            self._wake()
        return True

    def close(self) -> None:
        with self._lock:
            if self._wake_write < 0:
                return
            self._closed = True
            self._wake()
        self._thread.join(timeout=5.0)
        with self._lock:
            os.close(self._wake_write)
            self._wake_write = -1

    def _wake(self) -> None:
        """Called with the lock held, so close() cannot close the pipe under it."""
        # A full pipe already wakes the thread; a broken one has no thread left to wake.
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._wake_write, b"x")

    def _run(self) -> None:
        try:
            while True:
                exited = False
                for key, _ in self._selector.select():
                    if key.fd == self._wake_read:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_read, 4096)
                        continue
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    exited = True
                with self._lock:
                    if self._closed:
                        return
                    pending, self._pending = self._pending, []
                for pidfd in pending:
                    self._selector.register(pidfd, selectors.EVENT_READ)
                if exited:
                    self._on_exit()
        except Exception:  # noqa: BLE001 - the tick still reaps; only the early wake-up is lost
            log.exception("The exit watcher failed; worker exits are seen at the driver's tick.")
        finally:
            with self._lock:
                self._closed = True  # watch() says no from now on: nobody would see the exits
            for key in list(self._selector.get_map().values()):
                with contextlib.suppress(OSError):
                    os.close(key.fd)
            self._selector.close()
            with self._lock:
                pending, self._pending = self._pending, []
            for pidfd in pending:
                os.close(pidfd)
