"""Forwarding a worker's output to the driver's stdout, each line prefixed with its rank.

A thread per stream reads lines and writes them prefixed; ``prefix()`` is read per line
because a worker's rank changes from round to round. With ``--log-dir`` the raw lines
also go to the worker's own log file.

A forwarder reads its stream to EOF whatever happens to the places it writes to. Nothing
else drains a worker's pipe: were the thread to die, the worker would block on its next
print once the pipe is full (64 KiB) and hang there while its heartbeat thread tells the
driver all is well. So a driver stdout that fails (``lightning-elastic launch ... | head``
after ``head`` has exited: EPIPE) or a log file that fails ends the writing, never the reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from lightning_elastic.protocol import clip

log = logging.getLogger("lightning_elastic.driver")

# What writing to a dead stream raises: OSError for a broken pipe (EPIPE), a hung-up
# terminal (EIO), a full disk (ENOSPC); ValueError for a file already closed.
WRITE_ERRORS = (OSError, ValueError)


def describe(err: BaseException) -> str:
    """The reason, without the errno: "Broken pipe", "I/O operation on closed file"."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return reason.rstrip(".") or type(err).__name__


def discard_output(stream: IO[str]) -> None:
    """Point a dead stream's file descriptor at /dev/null.

    Text a failed flush could not write stays buffered in ``stream``, so every later flush
    fails again: ``launch()``'s own at the end, and the interpreter's at exit, which then
    prints "Exception ignored ... BrokenPipeError" and makes the exit status 120 instead of
    the job's. Written to /dev/null, it goes where the reader went. A stream without a
    descriptor (closed, or not a file) holds nothing a later flush could fail on.
    """
    try:
        fd = stream.fileno()
    except WRITE_ERRORS:  # io.UnsupportedOperation is both an OSError and a ValueError
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    with contextlib.suppress(*WRITE_ERRORS):
        stream.flush()  # drop what is still buffered now, into /dev/null


def flush_or_discard(stream: IO[str] | None) -> None:
    """Flush ``stream``; if it is dead, make sure no later flush can fail (``discard_output``)."""
    if stream is None:
        return
    try:
        stream.flush()
    except WRITE_ERRORS:
        discard_output(stream)


class OutputSink:
    """The driver's output (its stdout unless given), shared by the forwarders of a launcher.

    The first write that fails closes the sink for every forwarder: it is said once on the
    driver's log, and later lines are dropped here rather than failing again line after
    line (each forwarder still writes them to its own log file).
    """

    def __init__(self, out: IO[str] | None = None) -> None:
        self._out = out if out is not None else sys.stdout
        # One line at a time from several forwarders, and the first failure handled by one.
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, text: str) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._out.write(text)
                self._out.flush()
            except WRITE_ERRORS as err:
                self._closed = True
                name = getattr(self._out, "name", None) or type(self._out).__name__
                log.warning(
                    "Driver output %s is closed (%s): worker output is no longer shown; still draining it.",
                    name, describe(err),
                )
                # Else what the failed flush left buffered fails again at launch()'s own final
                # sys.stdout.flush(), which would lose the job's result.
                discard_output(self._out)


def as_sink(out: IO[str] | OutputSink | None) -> OutputSink:
    """``out`` itself if it is a sink already; else a sink of its own around it."""
    return out if isinstance(out, OutputSink) else OutputSink(out)


# The most of one line held in memory: a longer one is forwarded in pieces of this size.
MAX_LINE = 64 * 1024
# The most of a worker's last line kept to explain its failure (an exception's last line).
LAST_LINE_CHARS = 300
_PIECE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def segments(stream: IO[bytes], max_line: int = MAX_LINE) -> Iterator[bytes]:
    """What a terminal would show, piece by piece: lines ending in ``\n``, and progress
    updates ending in ``\r`` (tqdm redraws its bar so), each at most ``max_line`` bytes.
    A progress bar never ends a line: read by lines, it would be held whole in memory.
    """
    pending = b""
    while True:
        chunk = stream.read1(max_line) if hasattr(stream, "read1") else stream.read(max_line)
        if not chunk:
            break
        pending += chunk
        end = 0
        for piece in _PIECE.finditer(pending):
            yield piece.group()
            end = piece.end()
        pending = pending[end:]
        while len(pending) >= max_line:
            yield pending[:max_line]
            pending = pending[max_line:]
    if pending:
        yield pending


class LineForwarder:
    def __init__(
        self, stream: IO[bytes], prefix: Callable[[], str], log_file: Path | None, sink: OutputSink, name: str
    ) -> None:
        self._stream = stream
        self._prefix = prefix
        self._sink = sink
        self._log_file = log_file
        self._log = open(log_file, "a", buffering=1) if log_file else None  # noqa: SIM115
        self._thread = threading.Thread(target=self._forward, name=name, daemon=True)
        # The last line with text in it, bounded: what a failed worker said last (its
        # exception's last line), read once the stream ended (``join``).
        self.last_line = ""

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the stream's EOF; True once the thread has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _forward(self) -> None:
        try:
            for raw in segments(self._stream):
                line = raw.decode(errors="replace")
                if not line.endswith(("\n", "\r")):
                    line += "\n"
                if not self._sink.closed:
                    self._sink.write(f"{self._prefix()}{line}")
                self._write_log(line)
                if not line.isspace():
                    self.last_line = clip(line.strip(), LAST_LINE_CHARS)
        finally:
            # EOF: the worker and whatever it started have closed the pipe. Our end goes
            # too, so a job that replaces workers for weeks holds no descriptor per worker.
            with contextlib.suppress(OSError):
                self._stream.close()
            if self._log:
                with contextlib.suppress(*WRITE_ERRORS):
                    self._log.close()

    def _write_log(self, line: str) -> None:
        if self._log is None:
            return
        try:
            self._log.write(line)
        except WRITE_ERRORS as err:
            # A full disk must not stop the draining either; the driver's stdout still shows the lines.
            log.warning("Worker log %s failed (%s): no longer writing to it.", self._log_file, describe(err))
            with contextlib.suppress(*WRITE_ERRORS):
                self._log.close()
            self._log = None
