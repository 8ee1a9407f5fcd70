"""The driver's log lines, written by a thread of their own: a stalled stderr never stalls the driver.

The driver loop logs while it holds the registry lock, and every request of the rendezvous
service takes that lock: a write to a stderr that has stopped draining (``2>&1 | less``
left paused, a terminal on hold, a file on a hung network file system) would freeze the
service until the workers, hearing nothing, gave up. Here a log call only appends to a
bounded buffer; a writer thread empties it. When the buffer is full the newest lines are
dropped, counted, and said once the stream drains again: output degrades, never the job.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import IO

MAX_PENDING = 10_000  # lines buffered while the stream does not drain (with the batch being written: 2 MB at most)


class BackgroundStreamHandler(logging.Handler):
    def __init__(self, stream: IO[str], max_pending: int = MAX_PENDING) -> None:
        super().__init__()
        self._stream = stream
        self._max_pending = max_pending
        self._pending: collections.deque[str] = collections.deque()
        self._dropped = 0
        self._ready = threading.Condition(threading.Lock())
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:  # noqa: BLE001 - a bad format argument must not end the caller
            self.handleError(record)
            return
        with self._ready:
            if len(self._pending) >= self._max_pending:
                self._dropped += 1
                return
            self._pending.append(line)
            self._ready.notify()

    def _write_loop(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if not self._pending and self._closed:
                    return
                lines = list(self._pending)
                self._pending.clear()
                dropped, self._dropped = self._dropped, 0
            if dropped:
                lines.insert(0, f"lightning-elastic: {dropped} log line(s) dropped: the output did not drain\n")
            try:
                self._stream.write("".join(lines))
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: the lines are lost, the driver goes on

    def flush_within(self, timeout: float) -> None:
        """Let the writer empty the buffer, for at most ``timeout`` seconds (at exit)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._writer.join(timeout)

    def close(self) -> None:
        self.flush_within(5.0)
        super().close()
