"""lightning_elastic/preemption.py: SIGTERM as a graceful leave, and its fallbacks.

The handler is called directly (and once through a real SIGTERM in a child process), with
the driver's answer and the process exit injected.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from lightning_elastic.preemption import PreemptionHandler

pytestmark = pytest.mark.timeout(30)


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.died = 0
        self.event = threading.Event()

    def exit_process(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()

    def die(self) -> None:
        self.died += 1


def handler(graceful: bool, grace: float = 30.0) -> tuple[PreemptionHandler, Exits, list[str]]:
    asked: list[str] = []
    exits = Exits()

    def request_leave(reason: str) -> bool:
        asked.append(reason)
        return graceful

    return PreemptionHandler(request_leave, grace, exits.exit_process, exits.die), exits, asked


def test_a_first_sigterm_asks_the_driver_and_keeps_running():
    h, exits, asked = handler(graceful=True)
    h.handle(signal.SIGTERM, None)
    assert asked == ["SIGTERM (preemption notice)"]
    assert exits.died == 0 and exits.codes == []
    h.left()


def test_the_driver_saying_no_means_the_plain_sigterm_behaviour():
    h, exits, _ = handler(graceful=False)
    h.handle(signal.SIGTERM, None)
    assert exits.died == 1


def test_a_second_sigterm_ends_the_worker_without_asking_again():
    h, exits, asked = handler(graceful=True)
    h.handle(signal.SIGTERM, None)
    h.handle(signal.SIGTERM, None)
    assert exits.died == 1 and len(asked) == 1
    h.left()


def test_the_grace_running_out_exits_as_a_sigterm_would():
    h, exits, _ = handler(graceful=True, grace=0.05)
    h.handle(signal.SIGTERM, None)
    assert exits.event.wait(10), "the grace watchdog did not fire"
    assert exits.codes == [128 + signal.SIGTERM]


def test_leaving_in_time_stops_the_watchdog():
    h, exits, _ = handler(graceful=True, grace=0.5)
    h.handle(signal.SIGTERM, None)
    h.left()
    assert h.watchdog is not None
    h.watchdog.join(10)
    assert not h.watchdog.is_alive() and exits.codes == []


def test_a_real_sigterm_reaches_the_installed_handler_and_a_refusal_kills_by_the_signal():
    # In a child: the default die() must end the process by SIGTERM itself.
    code = textwrap.dedent("""
        import os, signal, sys, time
        from lightning_elastic.preemption import PreemptionHandler
        h = PreemptionHandler(lambda reason: (print("asked", reason, flush=True), False)[1], 30.0)
        h.install()
        assert PreemptionHandler.is_installed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        sys.exit(7)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "asked SIGTERM (preemption notice)" in proc.stdout
    assert "SIGTERM: exiting now" in proc.stderr
