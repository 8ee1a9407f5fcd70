"""Workers on other machines, started through the system OpenSSH client.

As with horovodrun and mpirun, hosts share a filesystem (or have the same paths): the
remote side runs ``cd CWD && exec PYTHON -m lightning_elastic.launcher.node.supervisor`` with the
driver's own interpreter and working directory. The supervisor receives the command, the
environment and the job secret on stdin (inside the encrypted channel), starts the worker
and reports its exit status on stderr; see ``supervisor.py`` for that small protocol.

The ssh client runs in BatchMode (never prompts), with a connect timeout and keep-alives,
and dies with the driver (PR_SET_PDEATHSIG): the closed connection then makes the
supervisor SIGKILL the worker, so no remote worker outlives the driver. With
``--state-dir`` the supervisor keeps its worker running instead, and a restarted driver
re-attaches to it (``SshLauncher.adopt``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lightning_elastic.launcher.config import SshSettings
from lightning_elastic.launcher.job.state import WorkerRecord
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.detached import CountingStream, keeper_mark, read_offset
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.node.spawn import start_supervisor_client
from lightning_elastic.launcher.node.supervisor import MARK
from lightning_elastic.launcher.restart.state_dir import StateDir, safe_name
from lightning_elastic.protocol import ENV_SECRET_FD

log = logging.getLogger(__name__)

# The driver's variables a remote worker gets besides the job's own ones and -x.
FORWARDED_BY_DEFAULT = ("PATH", "PYTHONPATH", "VIRTUAL_ENV")
STDERR_KEPT = 20  # lines of ssh's own stderr kept to explain a failure


def ssh_argv(settings: SshSettings, host: str) -> list[str]:
    """The ssh client's arguments up to (and including) the host.

    The user's ``-o`` options come first: ssh keeps the first value it sees for an option,
    so theirs override our defaults.
    """
    argv = ["ssh", "-T"]
    for option in settings.options:
        argv += ["-o", option]
    argv += [
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, round(settings.connect_timeout))}",
        "-o", f"ServerAliveInterval={max(1, round(settings.server_alive_interval))}",
        "-o", f"ServerAliveCountMax={settings.server_alive_count}",
    ]
    if settings.port is not None:
        argv += ["-p", str(settings.port)]
    if settings.identity_file is not None:
        argv += ["-i", str(settings.identity_file)]
    argv.append(host)
    return argv


def start_message(spec: WorkerSpec, env: dict[str, str]) -> dict[str, Any]:
    """What the supervisor reads first on its stdin (see supervisor.py): the worker's
    command, environment, directory and the job secret, which never reaches a command line."""
    return {
        "command": list(spec.command),
        "env": env,
        "cwd": spec.cwd,
        "secret": spec.secret,
        "secret_fd_variable": ENV_SECRET_FD,
    }


def remote_command(cwd: str, python: str = sys.executable) -> str:
    return f"cd {shlex.quote(cwd)} && exec {shlex.quote(python)} -m lightning_elastic.launcher.node.supervisor"


class SshLauncher:
    def __init__(self, settings: SshSettings, out: IO[str] | OutputSink | None = None,
                 state_dir: StateDir | None = None, secret: str = "") -> None:
        self._settings = settings
        self._sink = as_sink(out)  # one for all its workers: a broken stdout is reported once
        # --state-dir: workers outlive the connection (see supervisor.py), their files in
        # the same path on their host, under remote/ (the hosts may share this directory).
        self._state_dir = state_dir
        self._secret = secret  # the job's, for its keepers' marks (detached.keeper_mark)

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> SshProcess:
        env = {k: os.environ[k] for k in FORWARDED_BY_DEFAULT if k in os.environ}
        env.update(spec.env)
        start = start_message(spec, env)
        if self._state_dir is not None:
            start["detach"] = {"dir": str(self._state_dir.path / "remote"), "name": safe_name(spec.worker_id),
                               "mark": keeper_mark(spec.secret, spec.worker_id)}
        return self._connect(spec.host, spec.cwd, spec.worker_id, start, prefix, spec.log_file, None)

    def adopt(self, record: WorkerRecord, prefix: Callable[[], str]) -> SshProcess:
        """Re-attach to a worker a previous driver started (``--state-dir``; its record as saved)."""
        assert self._state_dir is not None
        offset = read_offset(self._state_dir.worker_file(record.worker_id, "offset"))
        attach = {"dir": str(self._state_dir.path / "remote"), "name": safe_name(record.worker_id),
                  "pid": record.keeper_pid, "ticks": record.start_ticks, "offset": offset,
                  "mark": keeper_mark(self._secret, record.worker_id)}
        log_file = Path(record.log_file) if record.log_file else None
        process = self._connect(record.slot.host, os.getcwd(), record.worker_id, {"attach": attach}, prefix,
                                log_file, offset)
        process.adoptable = (record.keeper_pid, record.start_ticks)
        return process

    def _connect(self, host: str, cwd: str, worker_id: str, message: dict, prefix: Callable[[], str],
                 log_file: Path | None, offset: int | None) -> SshProcess:
        argv = [*ssh_argv(self._settings, host), remote_command(cwd)]
        log.debug("Starting worker %s: %s", worker_id, shlex.join(argv))
        proc = start_supervisor_client(argv, host)
        assert proc.stdout is not None
        started: list[SshProcess] = []
        stream: IO[bytes] = proc.stdout
        if self._state_dir is not None:  # how far the output got, for the next driver
            stream = CountingStream(proc.stdout, self._state_dir.worker_file(worker_id, "offset"),  # type: ignore[assignment]
                                    lambda: offset if offset is not None else
                                    (started[0].output_base if started else None))
        forwarder = LineForwarder(stream, prefix, log_file, self._sink, f"ssh-output-{proc.pid}")
        forwarder.start()
        process = SshProcess(host, proc, forwarder)
        process.log_file = log_file
        started.append(process)
        process.send(json.dumps(message))
        return process


class SshProcess:
    def __init__(self, host: str, proc: subprocess.Popen[bytes], forwarder: LineForwarder) -> None:
        self._host = host
        self._proc = proc
        self._forwarder = forwarder
        self._lock = threading.Lock()
        self._status: int | None = None  # the worker's exit status, as the supervisor reported it
        self._stderr: list[str] = []  # ssh's (and the remote shell's) own messages
        self._killed = False
        # --state-dir: (pid, start ticks) of the remote keeper, and the byte of its output
        # file the relay started at, as the supervisor said ("started PID TICKS OFFSET").
        self.adoptable: tuple[int, int] | None = None
        self.output_base: int | None = None
        self.log_file: Path | None = None
        self._control = threading.Thread(target=self._read_control, name=f"ssh-control-{proc.pid}", daemon=True)
        self._control.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def child_pid(self) -> int | None:
        return self._proc.pid

    def send(self, line: str) -> None:
        """One line to the supervisor; a closed connection is not an error (poll tells)."""
        assert self._proc.stdin is not None
        with self._lock:
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def poll(self) -> int | None:
        if self._proc.poll() is None:
            return None
        return self._final_status()

    def wait(self, timeout: float) -> int | None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self._final_status()

    def signal(self, sig: int) -> None:
        self.send(f"signal {int(sig)}")
        if sig == signal.SIGKILL and self._proc.poll() is None:
            # Do not wait on a host that may be unreachable: closing our end of the
            # connection is enough, the supervisor SIGKILLs the worker when it sees EOF.
            self._killed = True
            self._proc.kill()

    def detach(self) -> None:
        """Close the session as a crashed driver would (EOF, no signal): with --state-dir the
        supervisor leaves its worker running for the next driver (a SIGTERM hand-over)."""
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()

    def finish_output(self, timeout: float = 5.0) -> None:
        self._forwarder.join(timeout)
        self._control.join(timeout)

    def last_line(self) -> str:
        return self._forwarder.last_line

    def exit_detail(self) -> str:
        if self._status is not None or self._killed or self._proc.returncode is None:
            return ""
        said = "; ".join(self._stderr[-3:]) or "no message"
        if self._proc.returncode == 255:
            return f"ssh to {self._host} failed: {said}"
        return f"the remote start on {self._host} failed (status {self._proc.returncode}): {said}"

    def _final_status(self) -> int:
        self._control.join(2.0)  # the status line may still be in the pipe
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # ssh has exited: nothing more to send it
        if self._status is not None:
            return self._status
        if self._killed:
            return -signal.SIGKILL
        return self._proc.returncode

    def _on_report(self, verb: str, value: str) -> None:
        """A supervisor report beyond exit and error (``started PID``; under Slurm, ``step``)."""

    def _read_control(self) -> None:
        assert self._proc.stderr is not None
        for raw in iter(self._proc.stderr.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if line.startswith(MARK):
                verb, _, value = line[len(MARK):].strip().partition(" ")
                if verb == "exit":
                    self._status = int(value)
                elif verb == "started" and len(value.split()) == 3:
                    pid, ticks, base = map(int, value.split())
                    self.adoptable, self.output_base = (pid, ticks), base
                elif verb == "error":
                    self._stderr.append(value)
                else:
                    self._on_report(verb, value)
                log.debug("Supervisor on %s: %s", self._host, line)
            elif line:
                self._stderr = [*self._stderr[-STDERR_KEPT:], line]
                log.debug("ssh %s: %s", self._host, line)
        with contextlib.suppress(OSError):
            self._proc.stderr.close()  # EOF: no descriptor kept per finished worker
