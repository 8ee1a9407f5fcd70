"""A file appended to by a thread of its own: the driver's loop never waits on a disk.

The driver emits timeline events (``events.jsonl``) from its decision loop, which holds
the registry lock every request of the rendezvous service needs. A write or flush to a
disk that stalls (a hung network file system, a saturated device) would freeze the
service until the workers, hearing nothing, gave up. Here ``append`` only queues the line;
a writer thread writes and flushes. A full queue drops the newest lines and counts them;
the first write error (a full disk, a file-size limit) ends the file: ``on_failure`` is
told once, later lines are dropped. Output degrades, never the job.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from pathlib import Path

MAX_PENDING = 10_000  # lines queued while the disk does not keep up (a few MB at most)


class BackgroundLineFile:
    def __init__(self, path: Path, on_failure: Callable[[OSError], None], max_pending: int = MAX_PENDING) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the writer thread
        self._on_failure = on_failure
        self._max_pending = max_pending
        self._pending: collections.deque[str] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._closed = False
        self.failed = False  # set by the writer thread; appends are dropped from then on
        self.dropped = 0  # lines dropped because the queue was full
        self._writer = threading.Thread(target=self._write_loop, name=f"writer-{path.name}", daemon=True)
        self._writer.start()

    def append(self, line: str) -> None:
        with self._ready:
            if self.failed or self._closed:
                return
            if len(self._pending) >= self._max_pending:
                self.dropped += 1
                return
            self._pending.append(line)
            self._ready.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds), then close the file."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        try:
            while True:
                with self._ready:
                    while not self._pending and not self._closed:
                        self._ready.wait()
                    if not self._pending:
                        return  # closed and drained
                    lines = "".join(self._pending)
                    self._pending.clear()
                try:
                    self._file.write(lines)
                    self._file.flush()
                except OSError as err:
                    with self._ready:
                        self.failed = True
                        self._pending.clear()
                    self._on_failure(err)
                    return
        finally:
            try:
                self._file.close()
            except OSError:
                pass  # its buffer could not be flushed either: the failure was said above
