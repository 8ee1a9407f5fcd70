"""Local workers that outlive the driver (``--state-dir``), and adopting them again.

Each worker runs under a keeper (``keeper.py``) started in a session of its own: killing
the driver, SIGKILL included, leaves both running. The worker writes its output to its
file in the state dir; the driver follows that file (``FollowFile``) and forwards it, with
the rank prefix, as it forwards a pipe. How far it got is saved beside the file, so the
next driver forwards what was written while no driver ran, from there on.

A restarted driver finds a worker again by its keeper's pid and that process's start time
(a pid reused by another process has another start time), and learns how it ended from
the status file its keeper writes: the exit status of a process that is not one's child
cannot be read otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.hosts.network import collective_interface_env
from lightning_elastic.launcher.job.state import WorkerRecord
from lightning_elastic.launcher.processes.base import EndedProcess, WorkerSpec
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.node.spawn import signal_group, spawn_worker
from lightning_elastic.launcher.restart.state_dir import StateDir
from lightning_elastic.protocol import ENV_SECRET_FD

log = logging.getLogger("lightning_elastic.driver")

KEEPER = Path(__file__).resolve().parent.parent / "node" / "keeper.py"
FOLLOW_POLL = 0.1  # seconds between looks at a worker's output file with nothing new


def process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])


def is_running(pid: int, ticks: int) -> bool:
    """Is ``pid`` still the process that started at ``ticks``, and not a zombie?"""
    found = process_start(pid)
    return found is not None and found[1] == ticks and found[0] not in ("Z", "X")


def keeper_mark(secret: str, worker_id: str) -> str:
    """What the keeper of this job's worker ``worker_id`` carries on its command line.

    A pid and its start time are anyone's to read (/proc), so a state naming them proves
    nothing: a restarted driver adopts a process only if it is a keeper (``KEEPER``) whose
    command line carries this mark, which only a holder of the job's secret can compute
    (the secret itself never reaches a command line)."""
    digest = hmac.new(secret.encode(), f"lightning-elastic keeper {worker_id}".encode(), hashlib.sha256)
    return f"job-{digest.hexdigest()[:32]}"


def is_keeper(pid: int, ticks: int, mark: str) -> bool:
    """Is ``pid`` (started at ``ticks``) still running, and this job's keeper of the worker
    whose ``keeper_mark`` is ``mark``?"""
    if not is_running(pid, ticks):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return str(KEEPER).encode() in argv and mark.encode() in argv


class FollowFile:
    """A growing file read like a pipe (``read1``): at its end it waits for more until
    ``ended()``, then returns what is left and EOF.

    The offset saved in ``offset_path`` is that of the bytes already handed out *and
    forwarded* (saved when the next read is asked for): a driver killed mid-chunk makes
    the next one show a few lines twice, never lose them.
    """

    def __init__(self, path: Path, offset_path: Path | None, ended: Callable[[], bool], offset: int = 0) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        # None: the reader keeps the offset (the ssh supervisor: its driver counts what arrives).
        self._offset_fd = os.open(offset_path, os.O_RDWR | os.O_CREAT, 0o600) if offset_path else -1
        self._offset = offset
        self._handed = offset
        self._ended = ended
        os.lseek(self._fd, offset, os.SEEK_SET)

    def read1(self, size: int) -> bytes:
        if self._handed != self._offset:
            self._offset = self._handed
            if self._offset_fd >= 0:
                with contextlib.suppress(OSError):
                    os.pwrite(self._offset_fd, f"{self._offset:020d}\n".encode(), 0)
        while True:
            data = os.read(self._fd, size)
            if not data and self._ended():
                data = os.read(self._fd, size)  # written just before the exit
                if not data:
                    return b""
            if data:
                self._handed += len(data)
                return data
            time.sleep(FOLLOW_POLL)

    def close(self) -> None:
        for fd in (self._fd, self._offset_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class CountingStream:
    """A pipe read like ``FollowFile``, saving how far its bytes were forwarded: an ssh
    supervisor's stdout, which relays the worker's file from ``base()`` on (None until the
    supervisor has said where it started)."""

    def __init__(self, stream: IO[bytes], offset_path: Path, base: Callable[[], int | None]) -> None:
        self._stream = stream
        self._offset_path = offset_path
        self._base = base
        self._handed = 0
        self._saved = -1

    def read1(self, size: int) -> bytes:
        base = self._base()
        if base is not None and base + self._handed != self._saved:
            self._saved = base + self._handed
            with contextlib.suppress(OSError):
                self._offset_path.write_text(f"{self._saved}\n")
        data = self._stream.read1(size)  # type: ignore[attr-defined]
        self._handed += len(data)
        return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()


def read_offset(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


class DetachedProcess:
    """A worker under its keeper: the driver's child (``popen``) or adopted from a previous driver."""

    def __init__(self, pid: int, ticks: int, status_path: Path, popen: subprocess.Popen[bytes] | None = None,
                 log_file: Path | None = None) -> None:
        self._pid = pid
        self.ticks = ticks  # its start time: with the pid, what a restarted driver finds it by
        self.log_file = log_file  # its --log-dir file, which the next driver appends to
        self._status_path = status_path
        self._popen = popen
        self._status: int | None = None
        self._forwarder: LineForwarder | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def adoptable(self) -> tuple[int, int]:
        """(pid, start ticks) a restarted driver finds it by."""
        return self._pid, self.ticks

    def follow(self, forwarder: LineForwarder) -> None:
        self._forwarder = forwarder
        forwarder.start()

    def poll(self) -> int | None:
        if self._status is not None:
            return self._status
        if self._popen is not None:
            code = self._popen.poll()
            if code is None:
                return None
        elif is_running(self._pid, self.ticks):
            return None
        else:
            code = -signal.SIGKILL  # gone without a status: its keeper was killed
        try:
            self._status = int(self._status_path.read_text().strip())
        except (OSError, ValueError):
            self._status = code
        return self._status

    def signal(self, sig: int) -> None:
        if self.poll() is None:  # never a process group that took over a reused pid
            signal_group(self._pid, sig)

    def wait(self, timeout: float) -> int | None:
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)
            return self.poll()
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def finish_output(self, timeout: float = 5.0) -> None:
        if self._forwarder is not None:
            self._forwarder.join(timeout)

    def exit_detail(self) -> str:
        return ""

    def last_line(self) -> str:
        return self._forwarder.last_line if self._forwarder is not None else ""


class LostProcess(EndedProcess):
    """A worker of the previous driver that could not be adopted (gone, or not local):
    lost, as a worker that exited without a status."""

    def __init__(self) -> None:
        super().__init__(-signal.SIGKILL)


class DetachedLauncher:
    """Starts local workers under keepers, their output in the state dir (see the module)."""

    def __init__(self, state_dir: StateDir, out: OutputSink | None = None, secret: str = "") -> None:
        self._dir = state_dir
        self._sink = as_sink(out)
        self._secret = secret  # the job's: what its keepers' marks are made from (``keeper_mark``)

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> DetachedProcess:
        env = {**os.environ, **spec.env}
        if "MASTER_ADDR" in env:  # collectives go out through the interface that reaches the driver
            env.update(collective_interface_env(env, env["MASTER_ADDR"]))
        program = spec.command[0]
        # Checked here: the keeper would only report it as an exit status 127.
        if shutil.which(program, path=env.get("PATH")) is None:
            raise StartError(f"COMMAND: {program}: No such file or directory or not executable")
        output, status = self._dir.worker_file(spec.worker_id, "log"), self._dir.worker_file(spec.worker_id, "status")
        with contextlib.suppress(FileNotFoundError):
            status.unlink()
        out_fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # its output: this user's alone
        try:
            os.fchmod(out_fd, 0o600)  # (a file of an older version may be 0644)
            offset = os.fstat(out_fd).st_size
            command = (sys.executable, "-I", str(KEEPER), str(status), ENV_SECRET_FD,
                       keeper_mark(spec.secret, spec.worker_id), "--", *spec.command)
            popen = spawn_worker(command, env, spec.secret, spec.cwd, out_fd, ENV_SECRET_FD, die_with_parent=False)
        except OSError as err:
            raise StartError(f"COMMAND: {program}: {err.strerror or err}") from None
        finally:
            os.close(out_fd)
        found = process_start(popen.pid)
        proc = DetachedProcess(popen.pid, found[1] if found else 0, status, popen, spec.log_file)
        self._follow(proc, spec.worker_id, spec.log_file, prefix, offset)
        return proc

    def adopt(self, record: WorkerRecord, prefix: Callable[[], str]) -> DetachedProcess | LostProcess:
        """The process of a worker the previous driver started (its record as saved), or a LostProcess."""
        status = self._dir.worker_file(record.worker_id, "status")
        pid, ticks = record.keeper_pid, record.start_ticks
        if pid <= 0 or not (is_running(pid, ticks) or status.exists()):
            return LostProcess()
        if is_running(pid, ticks) and not is_keeper(pid, ticks, keeper_mark(self._secret, record.worker_id)):
            # Its pid and start time match, which anyone can read: not proof enough to signal it.
            log.warning("--state-dir: process %d is not the keeper of worker %s of this job (its command line lacks "
                        "the job's mark): not adopted, never signalled.", pid, record.worker_id)
            return LostProcess()
        log_file = Path(record.log_file) if record.log_file else None
        proc = DetachedProcess(pid, ticks, status, log_file=log_file)
        offset = read_offset(self._dir.worker_file(record.worker_id, "offset"))
        self._follow(proc, record.worker_id, log_file, prefix, offset)
        return proc

    def _follow(self, proc: DetachedProcess, worker_id: str, log_file: Path | None,
                prefix: Callable[[], str], offset: int) -> None:
        stream = FollowFile(self._dir.worker_file(worker_id, "log"), self._dir.worker_file(worker_id, "offset"),
                            lambda: proc.poll() is not None, offset)
        proc.follow(LineForwarder(stream, prefix, log_file, self._sink, f"output-{proc.pid}"))  # type: ignore[arg-type]
