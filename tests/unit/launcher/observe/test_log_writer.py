"""launcher/observe/log_writer.py: logging never blocks on a stream that does not drain."""

from __future__ import annotations

import io
import logging
import threading
import time

import pytest

from lightning_elastic.launcher.observe.log_writer import BackgroundStreamHandler

pytestmark = pytest.mark.timeout(30)


class StalledStream(io.StringIO):
    """A stream whose writes block until it is released (a pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def write(self, text: str) -> int:
        self.released.wait()
        return super().write(text)


def test_logging_to_a_stalled_stream_returns_at_once_and_drops_what_does_not_fit():
    stream = StalledStream()
    handler = BackgroundStreamHandler(stream, max_pending=100)
    logger = logging.getLogger("test.log_writer")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        started = time.monotonic()
        for i in range(1000):
            logger.warning("line %d", i)
        assert time.monotonic() - started < 5  # a blocking handler would never return
        stream.released.set()
        handler.flush_within(10)
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "line 0\n" in text
    assert "log line(s) dropped: the output did not drain" in text
    assert text.count("\nline ") <= 2 * 100  # at most the buffer, and one batch the writer had taken
