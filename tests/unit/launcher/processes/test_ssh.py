"""launcher/processes/ssh.py: the ssh command line, and SshProcess driven through a fake ssh.

The fake ssh is a python process standing in for the ssh client: the remote command ssh
would run is its last argument, which it ignores. The "connected" fake exec's the real
supervisor, so the start message, the worker's output and its exit status take the same
path as over a real connection.
"""

from __future__ import annotations

import io
import json
import queue
import shlex
import signal
import sys
import time

import pytest

from lightning_elastic.launcher.config import SshSettings
from lightning_elastic.launcher.processes import ssh
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.ssh import SshLauncher, remote_command, ssh_argv
from lightning_elastic.protocol import ENV_SECRET_FD
from tests.unit.proc_tools import BOUND, REPO, wait_gone

pytestmark = pytest.mark.timeout(30)

SECRET = "remote-secret-99"

CONNECTED = (
    "import os, sys; os.chdir({repo!r}); "
    "os.execv(sys.executable, [sys.executable, '-m', 'lightning_elastic.launcher.node.supervisor'])"
).format(repo=str(REPO))
REFUSED = (
    "import sys; sys.stderr.write('ssh: connect to host x port 22: Connection refused\\n'); sys.exit(255)"
)
NO_PYTHON = (
    "import sys; sys.stderr.write('bash: line 1: /opt/venv/bin/python: No such file or directory\\n'); sys.exit(127)"
)
ECHO = "import sys; print(sys.stdin.readline().strip()); print(repr(sys.argv[1:]))"  # shows what ssh got
SILENT = "import time; time.sleep(60)"  # a host that never answers


# ----- ssh_argv / remote_command -------------------------------------------------------


def test_default_argv_has_batch_mode_timeouts_and_the_host_last():
    assert ssh_argv(SshSettings(), "node1") == [
        "ssh", "-T",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=10",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "node1",
    ]


def test_user_options_come_before_ours_and_port_and_identity_are_passed(tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("key")
    settings = SshSettings(port=2222, identity_file=key, options=("BatchMode=no", "StrictHostKeyChecking=no"))
    assert ssh_argv(settings, "user@node2") == [
        "ssh", "-T",
        "-o", "BatchMode=no",
        "-o", "StrictHostKeyChecking=no",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=10",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-p", "2222",
        "-i", str(key),
        "user@node2",
    ]


def test_timeouts_are_whole_seconds_of_at_least_one():
    argv = ssh_argv(SshSettings(connect_timeout=0.2, server_alive_interval=2.6, server_alive_count=7), "h")
    assert "ConnectTimeout=1" in argv and "ServerAliveInterval=3" in argv and "ServerAliveCountMax=7" in argv


def test_remote_command_quotes_the_directory_and_interpreter():
    command = remote_command("/data/my run's dir", "/opt/py env/bin/python")
    assert command == (
        "cd '/data/my run'\"'\"'s dir' && exec '/opt/py env/bin/python' -m lightning_elastic.launcher.node.supervisor"
    )
    assert shlex.split(command) == [
        "cd", "/data/my run's dir", "&&", "exec", "/opt/py env/bin/python", "-m", "lightning_elastic.launcher.node.supervisor",
    ]


def test_remote_command_defaults_to_this_interpreter():
    assert remote_command("/work") == f"cd /work && exec {shlex.quote(sys.executable)} -m lightning_elastic.launcher.node.supervisor"


# ----- SshProcess through a fake ssh ----------------------------------------------------


class QueueOut:
    """An ``out`` stream whose written lines a test can wait for, with a bound."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str] = queue.Queue()

    def write(self, text: str) -> None:
        for line in text.splitlines():
            self.lines.put(line)

    def flush(self) -> None:
        pass

    def next(self) -> str:
        try:
            return self.lines.get(timeout=BOUND)
        except queue.Empty:
            raise AssertionError(f"no output line within {BOUND} s") from None


@pytest.fixture
def fake_ssh(monkeypatch):
    """Makes SshLauncher run ``python -c CODE REMOTE_COMMAND`` instead of ssh; returns a starter."""
    started = []
    seen_hosts = []

    def start(code: str, command: str | None, tmp_path, host: str = "node9", env=None, out=None, argv=None):
        def fake_argv(settings, host_):
            seen_hosts.append(host_)
            return [sys.executable, "-c", code]

        monkeypatch.setattr(ssh, "ssh_argv", fake_argv)
        spec = WorkerSpec(
            worker_id="w1", host=host, command=argv or (sys.executable, "-c", command), env=env or {},
            secret=SECRET, cwd=str(tmp_path),
        )
        proc = SshLauncher(SshSettings(), out if out is not None else io.StringIO()).start(spec, lambda: "[1]: ")
        started.append(proc)
        return proc

    start.seen_hosts = seen_hosts
    yield start
    for proc in started:
        proc.signal(signal.SIGKILL)
        proc.wait(BOUND)
        proc.finish_output(BOUND)


def test_worker_output_and_status_come_through_the_connection(fake_ssh, tmp_path):
    out = io.StringIO()
    command = (
        f"import os, sys; print('secret', os.read(int(os.environ[{ENV_SECRET_FD!r}]), 100).decode()); "
        "print('job', os.environ['JOB_VAR']); print('pythonpath', os.environ['PYTHONPATH']); "
        "print('cwd', os.getcwd()); sys.exit(3)"
    )
    proc = fake_ssh(CONNECTED, command, tmp_path, env={"JOB_VAR": "job-value", "PYTHONPATH": "/job/lib"}, out=out)
    assert fake_ssh.seen_hosts == ["node9"]
    assert proc.wait(BOUND) == 3
    assert proc.poll() == 3
    proc.finish_output(BOUND)
    assert out.getvalue().splitlines() == [
        f"[1]: secret {SECRET}",
        "[1]: job job-value",
        "[1]: pythonpath /job/lib",
        f"[1]: cwd {tmp_path}",
    ]
    assert proc.exit_detail() == ""


def test_start_message_carries_command_env_cwd_and_secret_and_argv_does_not(fake_ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/forwarded/bin")
    monkeypatch.setenv("PYTHONPATH", "/forwarded/lib")
    monkeypatch.setenv("VIRTUAL_ENV", "/forwarded/venv")
    monkeypatch.setenv("NOT_FORWARDED_XYZ", "driver-only")
    out = io.StringIO()
    proc = fake_ssh(ECHO, "print('w')", tmp_path, env={"JOB_VAR": "v", "PYTHONPATH": "/job/lib"}, out=out)
    assert proc.wait(BOUND) == 0
    proc.finish_output(BOUND)
    message_line, argv_line = out.getvalue().splitlines()
    assert json.loads(message_line.removeprefix("[1]: ")) == {
        "command": [sys.executable, "-c", "print('w')"],
        "env": {"PATH": "/forwarded/bin", "PYTHONPATH": "/job/lib", "VIRTUAL_ENV": "/forwarded/venv", "JOB_VAR": "v"},
        "cwd": str(tmp_path),
        "secret": SECRET,
        "secret_fd_variable": ENV_SECRET_FD,
    }
    assert argv_line == "[1]: " + repr([remote_command(str(tmp_path))])
    assert SECRET not in argv_line


def test_sigterm_goes_to_the_remote_worker_and_its_status_comes_back(fake_ssh, tmp_path):
    out = QueueOut()
    proc = fake_ssh(CONNECTED, "import time; print('ready', flush=True); time.sleep(60)", tmp_path, out=out)
    assert out.next() == "[1]: ready"
    assert proc.poll() is None
    proc.signal(signal.SIGTERM)
    assert proc.wait(BOUND) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM
    assert proc.exit_detail() == ""


def test_sigkill_through_a_live_connection_gives_minus_nine_and_kills_the_worker(fake_ssh, tmp_path):
    out = QueueOut()
    proc = fake_ssh(CONNECTED, "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)", tmp_path,
                    out=out)
    word, pid = out.next().removeprefix("[1]: ").split()
    assert word == "pid"
    proc.signal(signal.SIGKILL)
    assert proc.wait(BOUND) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL
    assert proc.exit_detail() == ""
    assert wait_gone(int(pid))  # the supervisor died with the connection, and took the worker along


def test_ssh_failure_gives_255_and_names_the_host_and_ssh_message(fake_ssh, tmp_path):
    proc = fake_ssh(REFUSED, "print('never')", tmp_path, host="node9")
    assert proc.wait(BOUND) == 255
    assert proc.poll() == 255
    detail = proc.exit_detail()
    assert detail.startswith("ssh to node9 failed:")
    assert detail == "ssh to node9 failed: ssh: connect to host x port 22: Connection refused"


def test_remote_shell_failure_gives_its_status_and_message(fake_ssh, tmp_path):
    proc = fake_ssh(NO_PYTHON, "print('never')", tmp_path, host="node9")
    assert proc.wait(BOUND) == 127
    assert proc.exit_detail() == (
        "the remote start on node9 failed (status 127): bash: line 1: /opt/venv/bin/python: No such file or directory"
    )


def test_worker_that_cannot_start_remotely_is_explained(fake_ssh, tmp_path):
    proc = fake_ssh(CONNECTED, None, tmp_path, argv=("/nonexistent/program",))
    assert proc.wait(BOUND) == 127
    assert proc.exit_detail().startswith(
        "the remote start on node9 failed (status 127): cannot start '/nonexistent/program': "
    )


def test_sigkill_returns_promptly_when_the_remote_side_never_answers(fake_ssh, tmp_path):
    proc = fake_ssh(SILENT, "print('never')", tmp_path)
    proc.signal(signal.SIGTERM)  # only a line on the connection: nothing answers it
    assert proc.poll() is None
    began = time.monotonic()
    proc.signal(signal.SIGKILL)
    assert time.monotonic() - began < 0.5
    assert proc.wait(BOUND) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL
    assert proc.exit_detail() == ""
