"""Progress lines for long runs of the suite (``scripts/test.sh``).

``scripts/test.sh`` runs the suite in two pytest processes side by side and prints each one's
output whole at its end, so that the two do not interleave: without these lines a newcomer
would watch a silent terminal for a quarter of an hour.

``--progress-every SECONDS`` prints a line that often (checked as tests start and end): tests
done of the total, failures so far, the time since the start, and the file running.
``--progress-file PATH`` appends the lines to PATH instead of the terminal (one ``write`` of
one line each, so two processes can share the file), prefixed with ``--progress-label``.
"""

from __future__ import annotations

import os
import time

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("progress")
    group.addoption("--progress-every", type=float, default=0, metavar="SECONDS",
                    help="print a progress line (tests done, elapsed, file running) this often; 0: never")
    group.addoption("--progress-file", default=None, metavar="PATH",
                    help="append the progress lines to PATH instead of the terminal")
    group.addoption("--progress-label", default="", metavar="TEXT", help="the progress lines' prefix")


def pytest_configure(config: pytest.Config) -> None:
    every = config.getoption("progress_every")
    if every > 0:
        config.pluginmanager.register(Progress(config, every), "le-progress")


class Progress:
    """One line every ``every`` seconds while the tests run, and one at the end."""

    def __init__(self, config: pytest.Config, every: float) -> None:
        self.config = config
        self.every = every
        self.path = config.getoption("progress_file")
        self.label = config.getoption("progress_label")
        self.started = time.monotonic()
        self.last = self.started
        self.total = 0
        self.done = 0
        self.failed: set[str] = set()
        self.running = ""

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.running = nodeid.split("::")[0]
        self.maybe_say()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when == "teardown":
            self.done += 1
        self.maybe_say()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.running = ""
        self.say()

    def maybe_say(self) -> None:
        if time.monotonic() - self.last >= self.every:
            self.say()

    def say(self) -> None:
        self.last = now = time.monotonic()
        elapsed = int(now - self.started)
        doing = f"running {self.running}" if self.running else "ended"
        line = (f"{self.label}[{elapsed // 60}:{elapsed % 60:02d}] {self.done}/{self.total} tests done, "
                f"{len(self.failed)} failed; {doing}")
        if self.path:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write(f"\n{line}\n")  # between the dots of -q: a line of its own
