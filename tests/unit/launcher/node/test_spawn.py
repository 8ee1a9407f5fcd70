"""launcher/node/spawn.py: the worker's secret pipe, its own session, merged output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lightning_elastic.launcher.node.spawn import end_leftovers, exited, signal_group, spawn_worker
from tests.unit.proc_tools import BOUND, LineReader, is_gone, kill_quietly, wait_gone

pytestmark = pytest.mark.timeout(30)

SECRET = "s3cret-0123456789abcdef"
FD_VARIABLE = "MY_SECRET_FD"

# Reads the secret from the descriptor, reports what it sees, then stays alive for inspection.
CHILD = r"""
import os, sys, time
fd = int(os.environ["MY_SECRET_FD"])
data = b""
while chunk := os.read(fd, 4096):
    data += chunk
print("secret:" + data.decode(), flush=True)
print("stdin:" + repr(sys.stdin.read()), flush=True)
print("cwd:" + os.getcwd(), flush=True)
print("to-stderr", file=sys.stderr, flush=True)
print("ready", flush=True)
if "--stay" in sys.argv:
    time.sleep(60)
"""


@pytest.fixture
def started():
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
        proc = spawn_worker(
            [sys.executable, "-c", CHILD, *args],
            {**os.environ, **(env or {})},
            SECRET,
            cwd,
            subprocess.PIPE,
            FD_VARIABLE,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(BOUND)
        proc.stdout.close()


def test_child_reads_the_secret_from_the_named_descriptor_and_output_is_merged(started, tmp_path):
    proc = started(cwd=str(tmp_path))
    lines = LineReader(proc.stdout).rest()
    assert lines == [f"secret:{SECRET}", "stdin:''", f"cwd:{tmp_path}", "to-stderr", "ready"]
    assert proc.wait(BOUND) == 0


def test_secret_is_neither_on_the_command_line_nor_in_the_environment(started):
    proc = started("--stay")
    reader = LineReader(proc.stdout)
    assert reader.next() == f"secret:{SECRET}"
    while reader.next() != "ready":
        pass
    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
    environ = open(f"/proc/{proc.pid}/environ", "rb").read()
    assert b"--stay" in cmdline  # the right process was read
    assert f"{FD_VARIABLE}=".encode() in environ
    assert SECRET.encode() not in cmdline
    assert SECRET.encode() not in environ


def test_child_runs_in_its_own_session_and_process_group(started):
    proc = started("--stay")
    reader = LineReader(proc.stdout)
    while reader.next() != "ready":
        pass
    assert os.getsid(proc.pid) == proc.pid
    assert os.getpgid(proc.pid) == proc.pid
    assert os.getsid(proc.pid) != os.getsid(0)


def test_environment_is_the_given_one_plus_the_descriptor_variable():
    proc = spawn_worker(
        [sys.executable, "-c", "import os, sys; print(sorted(k for k in os.environ if not k.startswith('LC_')))"],
        {"ONLY_THIS": "1"},
        SECRET,
        None,
        subprocess.PIPE,
        FD_VARIABLE,
    )
    out, _ = proc.communicate(timeout=BOUND)
    assert out.decode().strip() == str(sorted(["ONLY_THIS", FD_VARIABLE]))


def test_signal_group_reaches_processes_the_child_started(started):
    grandchild = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('grandchild', p.pid, flush=True); p.wait()"
    proc = spawn_worker([sys.executable, "-c", grandchild], dict(os.environ), SECRET, None, subprocess.PIPE, FD_VARIABLE)
    try:
        reader = LineReader(proc.stdout)
        word, pid = reader.next().split()
        assert word == "grandchild"
        signal_group(proc.pid, signal.SIGKILL)
        assert proc.wait(BOUND) == -signal.SIGKILL
        assert reader.rest() == []  # EOF: the grandchild, holding the same pipe, is dead too
        assert wait_gone(int(pid))  # dying: exit closes descriptors just before the process is a zombie
    finally:
        kill_quietly(proc.pid)
        proc.wait(BOUND)
        proc.stdout.close()


def test_signal_group_of_a_finished_and_reaped_worker_does_not_raise(started):
    proc = started()
    LineReader(proc.stdout).rest()
    assert proc.wait(BOUND) == 0
    signal_group(proc.pid, signal.SIGTERM)
    signal_group(proc.pid, signal.SIGKILL)
    assert proc.poll() == 0


def test_an_exited_worker_is_seen_unreaped_and_what_it_left_in_its_group_is_ended():
    # The worker starts a child that would sleep a minute, then exits by itself.
    leaves = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print('child', p.pid, flush=True)")
    proc = spawn_worker([sys.executable, "-c", leaves], dict(os.environ), SECRET, None, subprocess.PIPE, FD_VARIABLE)
    try:
        reader = LineReader(proc.stdout)
        word, pid = reader.next().split()
        assert word == "child"
        assert exited(proc.pid, block=True)
        assert exited(proc.pid)  # asked again: still not reaped
        assert not is_gone(int(pid))  # what it left runs on in its group
        end_leftovers(proc.pid)
        assert wait_gone(int(pid))
        assert proc.poll() == 0  # reaped only now, with its own status
        assert not exited(proc.pid)  # reaped: its group's id is no longer safe to signal
    finally:
        kill_quietly(proc.pid)
        proc.wait(BOUND)
        proc.stdout.close()


def test_a_running_worker_has_not_exited(started):
    proc = started("--stay")
    LineReader(proc.stdout).next()
    assert not exited(proc.pid)


def test_missing_program_raises_and_leaks_no_descriptor():
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        spawn_worker(["/nonexistent/program"], {}, SECRET, None, subprocess.DEVNULL, FD_VARIABLE)
    assert set(os.listdir("/proc/self/fd")) == before
