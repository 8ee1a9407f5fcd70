"""ExitWatcher: the driver is woken by a child's exit itself, not by its next tick."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from lightning_elastic.launcher.processes.exit_watch import ExitWatcher

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd on this system")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_killed_child_wakes_the_watcher_and_is_then_reapable() -> None:
    exited = threading.Event()
    watcher = ExitWatcher(exited.set)
    child = _child()
    try:
        assert watcher.watch(child.pid)
        assert not exited.wait(0.2)  # a running child wakes nobody
        child.kill()
        assert exited.wait(10), "the exit did not wake the watcher"
        assert child.poll() == -9  # woken only once the exit can be reaped: the driver's poll sees it
    finally:
        child.kill()
        child.wait()
        watcher.close()


def test_every_exit_wakes_it_and_close_releases_every_descriptor() -> None:
    before = _open_fds()
    wakes: list[int] = []
    woken = threading.Condition()

    def on_exit() -> None:
        with woken:
            wakes.append(1)
            woken.notify_all()

    watcher = ExitWatcher(on_exit)
    children = [_child() for _ in range(3)]
    try:
        for child in children:
            assert watcher.watch(child.pid)
        for n, child in enumerate(children, 1):
            child.kill()
            with woken:
                assert woken.wait_for(lambda: len(wakes) >= n, timeout=10), f"exit {n} woke nobody"
            child.wait()
        survivor = _child()
        assert watcher.watch(survivor.pid)  # watched, still running when the watcher closes
    finally:
        for child in children:
            child.kill()
            child.wait()
        watcher.close()
    assert not watcher.watch(survivor.pid)  # closed: says no, holds nothing
    survivor.kill()
    survivor.wait()
    assert _open_fds() == before
