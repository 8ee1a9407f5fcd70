"""lightning_elastic/membership/preemption.py: SIGTERM as a graceful leave, and its fallbacks.

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
import time

import pytest

from lightning_elastic.membership.preemption import PreemptionHandler

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
        from lightning_elastic.membership.preemption import PreemptionHandler
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


def test_a_main_thread_blocked_in_native_code_still_leaves_within_the_grace():
    # The main thread blocks in a C call that no signal interrupts (a default mutex locked
    # twice: as a collective waits for a peer), so no Python-level handler can run. The
    # notice must still be acted on (the driver asked) and the grace must still end it.
    code = textwrap.dedent("""
        import ctypes, sys
        from lightning_elastic.membership.preemption import PreemptionHandler
        h = PreemptionHandler(lambda reason: (print("asked", reason, flush=True), True)[1], 1.0)
        h.install()
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER (glibc)
        libc.pthread_mutex_lock(mutex)
        print("blocked", flush=True)
        libc.pthread_mutex_lock(mutex)  # never returns
        sys.exit(7)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "blocked\n"
        # The main thread prints, then blocks: wait until it sits in the kernel.
        deadline = time.monotonic() + 10
        while _state(proc.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    elapsed = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 1.0 <= elapsed < 4.0, elapsed
    assert "asked SIGTERM (preemption notice)" in out
    assert "SIGTERM received: leaving the job" in err and "preemption grace of 1 s ran out" in err


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_forked_child_gets_plain_sigterm_and_no_share_of_the_wakeup_descriptor():
    # A DataLoader worker forked after init: its SIGTERM must kill it, and must not reach
    # the parent's watcher as a "second SIGTERM".
    code = textwrap.dedent("""
        import os, signal, sys, time
        from lightning_elastic.membership.preemption import PreemptionHandler
        h = PreemptionHandler(lambda reason: (print("asked", reason, flush=True), True)[1], 30.0)
        h.install()
        ready_r, ready_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(ready_w, b"x")
            time.sleep(30)
            os._exit(0)
        os.read(ready_r, 1)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        print("child", os.WIFSIGNALED(status) and os.WTERMSIG(status), flush=True)
        time.sleep(0.5)  # the watcher would have acted by now
        print("watchdog", h.watchdog is not None, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"child {int(signal.SIGTERM)}", "watchdog False"], proc.stdout


def test_a_wakeup_descriptor_set_later_by_someone_else_leaves_the_notice_to_the_python_handler():
    # An asyncio loop started in the main thread after init takes the wakeup descriptor:
    # the watcher hears nothing, so the Python handler must act (not swallow SIGTERM).
    code = textwrap.dedent("""
        import os, signal, socket, time
        from lightning_elastic.membership.preemption import PreemptionHandler
        h = PreemptionHandler(lambda reason: (print("asked", reason, flush=True), True)[1], 30.0)
        h.install()
        theirs, _ = socket.socketpair()
        theirs.setblocking(False)
        signal.set_wakeup_fd(theirs.fileno())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("watchdog", h.watchdog is not None, flush=True)
        h.left()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["asked SIGTERM (preemption notice)", "watchdog True"], proc.stdout


def test_a_sigterm_to_a_worker_already_leaving_lets_it_leave():
    # The driver stops a worker that was just told to exit at the rendezvous: its SIGTERM
    # must not turn that clean departure into a death by SIGTERM (a failure).
    h, exits, asked = handler(graceful=False)
    h.left()
    h.handle(signal.SIGTERM, None)
    assert asked == [] and exits.died == 0


def test_a_worker_that_starts_leaving_while_the_driver_is_asked_is_not_killed():
    # The watcher asked the driver (answered "exit now") while the main thread, told to
    # exit at the rendezvous, marked itself leaving.
    exits = Exits()
    box: list[PreemptionHandler] = []

    def request_leave(reason: str) -> bool:
        box[0].left()  # the main thread, meanwhile
        return False

    h = PreemptionHandler(request_leave, 30.0, exits.exit_process, exits.die)
    box.append(h)
    h.handle(signal.SIGTERM, None)
    assert exits.died == 0
