"""launcher/processes/output.py: a worker's pipe is drained to EOF whatever its outputs do.

A driver stdout that fails (``| head`` has exited: EPIPE; a closed file) or a log file that
fails stops only that writing: the forwarder keeps reading, so the worker never blocks on a
full pipe; the failure is logged once; a dead stdout is pointed at /dev/null so that no
later flush fails on what it still buffers.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from pathlib import Path

import pytest

from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, flush_or_discard
from tests.unit.proc_tools import BOUND

pytestmark = pytest.mark.timeout(30)

LINE = "y" * 99 + "\n"
COUNT = 2000  # 200 KB: three times what a pipe holds, so an undrained writer blocks


class BrokenOut(io.StringIO):
    """An ``out`` whose reader is gone: every write fails, as on a pipe after EPIPE."""

    name = "<broken>"

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")


class Worker:
    """A pipe and a thread writing COUNT lines into it, as a worker prints; then EOF."""

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()
        self.stream = os.fdopen(read_fd, "rb")
        self._thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        try:
            with os.fdopen(self._write_fd, "wb") as pipe:
                for _ in range(COUNT):
                    pipe.write(LINE.encode())
        except BrokenPipeError:
            pass  # the test closed the read end after it failed: nothing left to check here

    def start(self) -> Worker:
        self._thread.start()
        return self

    def finished(self) -> bool:
        """Did every line get into the pipe? Only if someone kept reading it."""
        self._thread.join(BOUND)
        return not self._thread.is_alive()


@pytest.fixture
def started():
    """Forwarders and worker streams to close after the test, whatever it did."""
    items: list[tuple[Worker, LineForwarder]] = []
    yield items
    for worker, forwarder in items:
        forwarder.join(BOUND)
        worker.stream.close()  # a writer still blocked on a full pipe gets EPIPE and ends
        worker.finished()


def forward(started, sink: OutputSink, log_file: Path | None = None, name: str = "w0") -> tuple[Worker, LineForwarder]:
    worker = Worker()
    forwarder = LineForwarder(worker.stream, lambda: "[0]: ", log_file, sink, f"output-{name}")
    started.append((worker, forwarder))
    forwarder.start()
    worker.start()
    return worker, forwarder


def warnings(caplog) -> list[str]:
    """The driver log's warnings, as the user reads them."""
    return [r.getMessage() for r in caplog.records
            if r.name == "lightning_elastic.driver" and r.levelno == logging.WARNING]


def test_broken_stdout_keeps_draining_and_logging(started, tmp_path, caplog):
    """out raises BrokenPipeError: the whole stream is still read to EOF and logged; one warning."""
    caplog.set_level(logging.WARNING, logger="lightning_elastic.driver")
    out = BrokenOut()
    log_file = tmp_path / "w0.log"
    worker, forwarder = forward(started, OutputSink(out), log_file)
    assert worker.finished(), "the worker blocked on a full pipe: nobody drained it"
    assert forwarder.join(BOUND), "the forwarder did not reach EOF"
    assert log_file.read_text() == LINE * COUNT
    assert out.writes == 1  # after the first failure the sink stops trying
    assert warnings(caplog) == [
        "Driver output <broken> is closed (Broken pipe): worker output is no longer shown; still draining it."
    ]


def test_one_warning_for_all_forwarders_of_a_sink(started, caplog):
    """Two workers' forwarders sharing a broken sink: both drained, the failure said once."""
    caplog.set_level(logging.WARNING, logger="lightning_elastic.driver")
    sink = OutputSink(BrokenOut())
    pairs = [forward(started, sink, name=name) for name in ("w0", "w1")]
    for worker, forwarder in pairs:
        assert worker.finished()
        assert forwarder.join(BOUND)
    assert sink.closed
    assert len(warnings(caplog)) == 1


def test_closed_out_file_is_a_failure_like_any_other(started, caplog):
    """Writing to a closed file raises ValueError, not OSError: handled the same way."""
    caplog.set_level(logging.WARNING, logger="lightning_elastic.driver")
    out = io.StringIO()
    out.close()
    worker, forwarder = forward(started, OutputSink(out))
    assert worker.finished()
    assert forwarder.join(BOUND)
    assert len(warnings(caplog)) == 1
    assert "(I/O operation on closed file)" in warnings(caplog)[0]


def test_real_broken_pipe_is_pointed_at_devnull(started, caplog):
    """A text file on a pipe whose reader closed: after the sink's failure, flushing it works.

    A failed flush leaves the text buffered, so without /dev/null under the descriptor every
    later flush (``launch()``'s own, the interpreter's at exit) would raise again.
    """
    caplog.set_level(logging.WARNING, logger="lightning_elastic.driver")
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    with open(write_fd, "w") as out:
        sink = OutputSink(out)
        sink.write("lost\n")
        assert sink.closed
        out.write("more, buffered\n")
        out.flush()  # /dev/null now: no BrokenPipeError
        assert os.path.samestat(os.fstat(write_fd), os.stat(os.devnull))
    assert len(warnings(caplog)) == 1
    assert "(Broken pipe)" in warnings(caplog)[0]


def test_failing_log_file_does_not_stop_the_forwarding(started, caplog):
    """A log file that fails (ENOSPC on /dev/full): stdout still gets every line; one warning."""
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full here")
    caplog.set_level(logging.WARNING, logger="lightning_elastic.driver")
    out = io.StringIO()
    worker, forwarder = forward(started, OutputSink(out), full)
    assert worker.finished()
    assert forwarder.join(BOUND)
    assert out.getvalue() == f"[0]: {LINE}" * COUNT
    assert len(warnings(caplog)) == 1
    assert "Worker log /dev/full failed (No space left on device)" in warnings(caplog)[0]


def test_flush_or_discard_leaves_no_failing_flush_behind():
    """What ``main()`` does at its end: a dead stream is flushed into /dev/null, a live one as usual."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    with open(write_fd, "w") as dead:
        dead.write("buffered for a reader who left\n")
        flush_or_discard(dead)
        dead.write("and later\n")
        dead.flush()  # the interpreter's flush at exit: no longer fails
    live = io.StringIO()
    live.write("kept")
    flush_or_discard(live)
    flush_or_discard(None)  # no stream at all (pythonw): nothing to do
    assert live.getvalue() == "kept"


# ----- progress bars and endless lines --------------------------------------------------


def test_progress_updates_are_forwarded_as_a_terminal_shows_them():
    from lightning_elastic.launcher.processes.output import segments

    stream = io.BufferedReader(io.BytesIO(b"epoch 0\n 10%|#  \r 20%|##  \r 30%|### \r\ndone"))
    assert list(segments(stream)) == [b"epoch 0\n", b" 10%|#  \r", b" 20%|##  \r", b" 30%|### \r\n", b"done"]


def test_an_endless_line_is_forwarded_in_bounded_pieces():
    from lightning_elastic.launcher.processes.output import segments

    stream = io.BufferedReader(io.BytesIO(b"x" * 1000 + b"\n"), buffer_size=64)
    pieces = list(segments(stream, max_line=256))
    assert b"".join(pieces) == b"x" * 1000 + b"\n"
    assert max(map(len, pieces)) < 2 * 256  # held in memory: at most two reads


def test_the_forwarder_keeps_the_last_line_with_text_bounded():
    # What explains a worker that failed before it joined: its exception's last line.
    from lightning_elastic.launcher.processes.output import LAST_LINE_CHARS

    text = (b"Traceback (most recent call last):\n  File \"train.py\", line 1\n"
            b"ModuleNotFoundError: No module named 'nosuch'\n\n  \n")
    forwarder = LineForwarder(io.BufferedReader(io.BytesIO(text)), lambda: "", None, OutputSink(io.StringIO()), "w")
    forwarder.start()
    assert forwarder.join(BOUND)
    assert forwarder.last_line == "ModuleNotFoundError: No module named 'nosuch'"
    long_words = b"word " * 200 + b"\n"
    forwarder = LineForwarder(io.BufferedReader(io.BytesIO(long_words)), lambda: "", None, OutputSink(io.StringIO()), "w")
    forwarder.start()
    assert forwarder.join(BOUND)
    assert len(forwarder.last_line) <= LAST_LINE_CHARS and forwarder.last_line.endswith("word...")
