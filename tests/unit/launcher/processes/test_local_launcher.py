"""launcher/processes/local.py: a worker as a child of the driver, its output prefixed."""

from __future__ import annotations

import io
import itertools
import signal
import sys

import pytest

from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.local import LocalLauncher
from lightning_elastic.protocol import ENV_SECRET_FD
from tests.unit.proc_tools import BOUND

pytestmark = pytest.mark.timeout(30)

SECRET = "local-secret-42"

REPORT = r"""
import os, sys
fd = int(os.environ[sys.argv[1]])
print("secret", os.read(fd, 100).decode())
for name in sys.argv[2:]:
    print(name, os.environ.get(name, "<unset>"))
print("cwd", os.getcwd())
"""


@pytest.fixture
def processes():
    started = []
    yield started
    for proc in started:
        proc.signal(signal.SIGKILL)
        proc.wait(BOUND)
        proc.finish_output(BOUND)


def start(processes, command, tmp_path, out, env=None, prefix=lambda: "[0]: ", log_file=None):
    spec = WorkerSpec(
        worker_id="w0",
        host="localhost",
        command=tuple(command),
        env=env or {},
        secret=SECRET,
        cwd=str(tmp_path),
        log_file=log_file,
    )
    proc = LocalLauncher(out).start(spec, prefix)
    processes.append(proc)
    return proc


def test_output_lines_are_prefixed_and_logged_raw(processes, tmp_path):
    out = io.StringIO()
    log_file = tmp_path / "w0.log"
    code = "import sys; print('one'); print('two', file=sys.stderr, flush=True); sys.stdout.write('no newline')"
    proc = start(processes, [sys.executable, "-c", code], tmp_path, out, log_file=log_file)
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    assert out.getvalue() == "[0]: one\n[0]: two\n[0]: no newline\n"
    assert log_file.read_text() == "one\ntwo\nno newline\n"
    assert proc.exit_detail() == ""


def test_prefix_is_read_for_every_line(processes, tmp_path):
    out = io.StringIO()
    counter = itertools.count()
    code = "print('a'); print('b'); print('c')"
    proc = start(processes, [sys.executable, "-c", code], tmp_path, out, prefix=lambda: f"[{next(counter)}]: ")
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    assert out.getvalue() == "[0]: a\n[1]: b\n[2]: c\n"


def test_log_file_is_appended_to(processes, tmp_path):
    log_file = tmp_path / "w0.log"
    log_file.write_text("earlier round\n")
    proc = start(processes, [sys.executable, "-c", "print('later')"], tmp_path, io.StringIO(), log_file=log_file)
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    assert log_file.read_text() == "earlier round\nlater\n"


def test_spec_env_is_laid_over_the_drivers_environment(processes, tmp_path, monkeypatch):
    monkeypatch.setenv("FROM_DRIVER", "driver-value")
    monkeypatch.setenv("OVERRIDDEN", "driver-value")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "user-choice")
    out = io.StringIO()
    names = ["FROM_DRIVER", "OVERRIDDEN", "FROM_SPEC", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", ENV_SECRET_FD]
    proc = start(
        processes,
        [sys.executable, "-c", REPORT, ENV_SECRET_FD, *names],
        tmp_path,
        out,
        env={"OVERRIDDEN": "spec-value", "FROM_SPEC": "spec-only", "MASTER_ADDR": "127.0.0.1"},
        prefix=lambda: "",
    )
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"secret {SECRET}"
    assert lines[1:6] == [
        "FROM_DRIVER driver-value",
        "OVERRIDDEN spec-value",
        "FROM_SPEC spec-only",
        "GLOO_SOCKET_IFNAME lo",  # the interface that reaches MASTER_ADDR
        "NCCL_SOCKET_IFNAME user-choice",  # the user's own value is kept
    ]
    assert lines[6].startswith(f"{ENV_SECRET_FD} ") and lines[6].split()[1].isdigit()
    assert lines[7] == f"cwd {tmp_path}"
    assert SECRET not in " ".join(lines[1:])


def test_without_master_addr_no_interface_variable_is_added(processes, tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    out = io.StringIO()
    proc = start(processes, [sys.executable, "-c", REPORT, ENV_SECRET_FD, "GLOO_SOCKET_IFNAME"], tmp_path, out,
                 prefix=lambda: "")
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    assert out.getvalue().splitlines()[1] == "GLOO_SOCKET_IFNAME <unset>"


def test_poll_then_sigkill_gives_minus_nine(processes, tmp_path):
    proc = start(processes, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, io.StringIO())
    assert proc.poll() is None
    assert proc.wait(0.01) is None
    proc.signal(signal.SIGKILL)
    assert proc.wait(BOUND) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL
    assert proc.exit_detail() == ""
    proc.signal(signal.SIGTERM)  # a finished worker: not an error


def test_exit_status_is_the_workers(processes, tmp_path):
    proc = start(processes, [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path, io.StringIO())
    assert proc.wait(BOUND) == 3
    assert proc.poll() == 3
    assert proc.pid > 0
