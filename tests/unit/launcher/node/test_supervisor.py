"""launcher/node/supervisor.py, run for real as a local subprocess (no ssh).

The test plays the driver's side of the connection: the start line and ``signal N``
lines on stdin, the worker's output on stdout, the supervisor's reports on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from lightning_elastic.launcher.node.supervisor import MARK
from tests.unit.proc_tools import BOUND, REPO, LineReader, is_gone, kill_quietly, wait_gone

pytestmark = pytest.mark.timeout(30)

SECRET = "supervised-secret-7"
SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


class Supervisor:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_elastic.launcher.node.supervisor"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.out = LineReader(self.proc.stdout)
        self.err = LineReader(self.proc.stderr)
        self.worker_pid: int | None = None

    def send(self, line: bytes) -> None:
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def start(self, code: str, env: dict | None = None, cwd: str = "/", **fields) -> int:
        message = {
            "command": [sys.executable, "-c", code],
            "env": env or {},
            "cwd": cwd,
            "secret": SECRET,
            "secret_fd_variable": "SUPERVISED_SECRET_FD",
            **fields,
        }
        self.send(json.dumps(message).encode())
        started = self.err.next()
        assert started is not None and started.startswith(f"{MARK} started "), started
        self.worker_pid = int(started.split()[-1])
        return self.worker_pid

    def close(self) -> None:
        if self.worker_pid is not None:
            kill_quietly(self.worker_pid)
        kill_quietly(self.proc.pid)
        self.proc.wait(BOUND)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture
def supervisor():
    s = Supervisor()
    yield s
    s.close()


def test_worker_output_goes_to_stdout_and_the_exit_to_stderr(supervisor, tmp_path):
    code = (
        "import os, sys; fd = int(os.environ['SUPERVISED_SECRET_FD']); "
        "print('secret', os.read(fd, 100).decode()); print('var', os.environ['JOB_VAR']); "
        "print('cwd', os.getcwd()); print('on stderr', file=sys.stderr)"
    )
    pid = supervisor.start(code, env={"JOB_VAR": "job-value"}, cwd=str(tmp_path))
    assert supervisor.out.rest() == [f"secret {SECRET}", "var job-value", f"cwd {tmp_path}", "on stderr"]
    assert supervisor.err.rest() == [f"{MARK} exit 0"]
    assert supervisor.proc.wait(BOUND) == 0
    assert pid != supervisor.proc.pid


def test_worker_exit_status_is_reported(supervisor):
    supervisor.start("import sys; sys.exit(3)")
    assert supervisor.err.rest() == [f"{MARK} exit 3"]
    assert supervisor.proc.wait(BOUND) == 0


def test_signal_line_reaches_the_worker(supervisor):
    pid = supervisor.start(SLEEPER)
    assert supervisor.out.next() == "ready"
    supervisor.send(b"signal 15")
    assert supervisor.err.next() == f"{MARK} exit -15"
    assert supervisor.proc.wait(BOUND) == 0
    assert is_gone(pid)


def test_unknown_control_lines_are_ignored(supervisor):
    supervisor.start(SLEEPER)
    assert supervisor.out.next() == "ready"
    supervisor.send(b"signal TERM")
    supervisor.send(b"hello")
    supervisor.send(b"signal 15")
    assert supervisor.err.next() == f"{MARK} exit -15"


def test_end_of_stdin_kills_the_worker(supervisor):
    pid = supervisor.start(SLEEPER)
    assert supervisor.out.next() == "ready"
    supervisor.proc.stdin.close()  # the driver or the connection is gone
    assert supervisor.err.next() == f"{MARK} exit -9"
    assert supervisor.proc.wait(BOUND) == 0
    assert wait_gone(pid)


def test_sigkill_of_the_supervisor_kills_the_worker(supervisor):
    pid = supervisor.start(SLEEPER)
    assert supervisor.out.next() == "ready"
    supervisor.proc.kill()
    assert supervisor.proc.wait(BOUND) == -signal.SIGKILL
    # stdout reaches EOF only once the worker, which writes to it directly, has died too.
    assert supervisor.out.rest() == []
    assert wait_gone(pid)


def test_sigterm_of_the_supervisor_kills_the_worker(supervisor):
    pid = supervisor.start(SLEEPER)
    assert supervisor.out.next() == "ready"
    supervisor.proc.terminate()
    assert supervisor.err.next() == f"{MARK} exit -9"
    assert wait_gone(pid)


def valid_start() -> dict:
    return {"command": ["true"], "env": {}, "cwd": "/", "secret": "s", "secret_fd_variable": "FD"}


def without(key: str) -> dict:
    message = valid_start()
    del message[key]
    return message


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (json.dumps(without("secret_fd_variable")), "start message: field 'secret_fd_variable' missing or not a str"),
        (json.dumps(without("secret")), "start message: field 'secret' missing or not a str"),
        (json.dumps({**valid_start(), "command": "true"}), "start message: field 'command' missing or not a list"),
        (json.dumps({**valid_start(), "command": []}), "start message: 'command' must be a non-empty list of strings"),
        (json.dumps({**valid_start(), "command": ["true", 1]}),
         "start message: 'command' must be a non-empty list of strings"),
        (json.dumps({**valid_start(), "env": {"A": 1}}), "start message: 'env' must map strings to strings"),
        ("not json", "Expecting value: line 1 column 1 (char 0)"),
    ],
    ids=["no-fd-variable", "no-secret", "command-not-a-list", "empty-command", "non-string-argument",
         "non-string-env", "not-json"],
)
def test_malformed_start_line_is_refused_with_status_2(supervisor, line, message):
    supervisor.send(line.encode())
    assert supervisor.err.rest() == [f"{MARK} error {message}"]
    assert supervisor.proc.wait(BOUND) == 2
    assert supervisor.out.rest() == []


def test_eof_before_the_start_line_is_refused_with_status_2(supervisor):
    supervisor.proc.stdin.close()
    assert supervisor.err.rest() == [f"{MARK} error Expecting value: line 1 column 1 (char 0)"]
    assert supervisor.proc.wait(BOUND) == 2


@pytest.mark.parametrize("line", ["[]", "null", '"start"'])
def test_start_line_that_is_not_a_json_object_is_refused_with_status_2(supervisor, line):
    supervisor.send(line.encode())
    lines = supervisor.err.rest()
    assert supervisor.proc.wait(BOUND) == 2
    assert len(lines) == 1 and lines[0].startswith(f"{MARK} error ")


def test_command_that_cannot_start_is_reported_with_status_127(supervisor):
    supervisor.send(json.dumps({**valid_start(), "command": ["/nonexistent/program"]}).encode())
    lines = supervisor.err.rest()
    assert len(lines) == 1
    assert lines[0].startswith(f"{MARK} error cannot start '/nonexistent/program': ")
    assert "No such file or directory" in lines[0]
    assert supervisor.proc.wait(BOUND) == 127


def test_importing_the_supervisor_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-c", "import lightning_elastic.launcher.node.supervisor, sys; print('torch' in sys.modules)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BOUND * 4,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"
