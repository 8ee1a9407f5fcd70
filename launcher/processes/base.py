"""The contract between the driver and whatever starts worker processes.

The driver decides *which* workers run and when; a ``WorkerLauncher`` only starts one from
a ``WorkerSpec`` and hands back a ``WorkerProcess`` to poll, signal and reap. Local
subprocesses, ssh and Slurm steps are the implementations here; a cluster engine (Ray) or a
simulation plugs in the same way without touching the driver's decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker, on any host.

    ``env`` holds the job's own variables (rank plan, driver address, PYTHONPATH with the
    autoload directory, ``-x`` values); each launcher lays them over the host's own
    environment. ``secret`` is kept apart: a launcher must hand it over without putting it
    on a command line or in the environment (where ``ps`` shows it).
    """

    worker_id: str
    host: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    secret: str = dataclasses.field(repr=False)  # never in a log line or a traceback
    cwd: str
    log_file: Path | None = None


class WorkerProcess(Protocol):
    """A started worker, as the driver sees it."""

    @property
    def pid(self) -> int:
        """A local process id to name it in logs (for ssh: the ssh client's)."""
        ...

    @property
    def child_pid(self) -> int | None:
        """The pid of this driver's child process whose exit is the worker's (the worker
        itself, or its ssh client), to be woken by its exit; None for a worker that is no
        child of the driver (a Ray actor): its exit is seen by ``poll`` alone."""
        ...

    def poll(self) -> int | None:
        """None while running; else the exit status (negative: killed by that signal)."""
        ...

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker and everything it started; never raises once it exited."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Like ``poll`` after waiting at most ``timeout`` seconds for the exit."""
        ...

    def finish_output(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until the exited worker's output has all been forwarded."""
        ...

    def exit_detail(self) -> str:
        """Why the process ended, beyond its status (e.g. the ssh error), or ''."""
        ...

    def last_line(self) -> str:
        """The last line of output it forwarded (bounded), or ''; complete once
        ``finish_output`` returned."""
        ...


class EndedProcess:
    """A worker process that has already ended: reaped at the next turn with ``status`` and
    ``detail``. What stands in for a process the driver could not start or could not find."""

    pid = 0
    child_pid = None

    def __init__(self, status: int, detail: str = "") -> None:
        self._status = status
        self._detail = detail

    def poll(self) -> int | None:
        return self._status

    def signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float) -> int | None:
        return self._status

    def finish_output(self, timeout: float = 5.0) -> None:
        pass

    def exit_detail(self) -> str:
        return self._detail

    def last_line(self) -> str:
        return ""


class NotStarted(EndedProcess):
    """A worker whose start failed on this machine's side (its file in ``--state-dir`` or
    ``--log-dir`` could not be created: a full disk, an I/O error): lost with ``reason``,
    so that its slot pays for it, not the job."""

    def __init__(self, reason: str) -> None:
        super().__init__(127, reason)  # as a shell says of a command it could not run


class WorkerLauncher(Protocol):
    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> WorkerProcess:
        """Start the worker; ``prefix()`` is read for every output line (the rank can change).

        Raises ``StartError`` when no process could be started (the command, or ssh, cannot
        be executed on this machine); a worker that starts and then fails is a process
        whose exit says so.
        """
        ...


class HostRouter:
    """Local hosts to one launcher, every other host to another (ssh)."""

    def __init__(
        self, local: WorkerLauncher, remote: WorkerLauncher, is_local: Callable[[str], bool]
    ) -> None:
        self._local = local
        self._remote = remote
        self._is_local = is_local

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> WorkerProcess:
        launcher = self._local if self._is_local(spec.host) else self._remote
        return launcher.start(spec, prefix)


def stop_all(processes: Sequence[WorkerProcess], grace: float) -> None:
    """SIGTERM every process, then SIGKILL those still running after ``grace`` seconds.

    SIGTERM first lets a worker clean up (close files, leave its process group); SIGKILL
    after a bound because a hung or SIGSTOPped worker would never act on SIGTERM. Every
    process gets the same grace at once: one deadline for all, not one after another (64
    workers stuck in a collective would otherwise take 64 graces).
    """
    running = [p for p in processes if p.poll() is None]
    for p in running:
        p.signal(signal.SIGTERM)
        p.signal(signal.SIGCONT)  # a stopped process only sees SIGTERM once continued
    deadline = time.monotonic() + grace
    hung = [p for p in running if p.wait(max(0.0, deadline - time.monotonic())) is None]
    if hung:
        log.warning("%d worker process(es) ignored SIGTERM for %.0f s: killing them (pid %s).",
                    len(hung), grace, ", ".join(str(p.pid) for p in hung))
        for p in hung:
            p.signal(signal.SIGKILL)
        deadline = time.monotonic() + grace
        for p in hung:
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in processes:
        p.finish_output()
