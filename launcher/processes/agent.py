"""Workers on hosts whose agent connected to the driver (``lightning-elastic agent``).

Starting one is queueing an order on the ``AgentBoard``; the agent takes it at its next poll
(at once: its poll is waiting) and reports the worker's start, output and exit. Everything
the driver's loop calls here works in memory: a slow or unreachable agent never holds it.
The worker's environment is the one an ssh-started worker gets: the job's variables over
the driver's ``PATH``, ``PYTHONPATH`` and ``VIRTUAL_ENV`` (``ssh.FORWARDED_BY_DEFAULT``),
laid by the agent over its own environment; the job secret is the agent's own (it has it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from lightning_elastic.launcher.job.state import WorkerRecord
from lightning_elastic.launcher.processes.base import WorkerLauncher, WorkerProcess, WorkerSpec
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.processes.ssh import FORWARDED_BY_DEFAULT
from lightning_elastic.launcher.service.agent_board import AgentBoard, WorkerFate


class AgentLauncher:
    """Hosts an agent serves to the agent, every other host to ``others`` (local, ssh)."""

    def __init__(self, board: AgentBoard, others: WorkerLauncher | None,
                 out: IO[str] | OutputSink | None = None) -> None:
        self._board = board
        self._others = others
        self._sink = as_sink(out)

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> WorkerProcess:
        if self._others is not None and not self._board.serves(spec.host):
            return self._others.start(spec, prefix)
        env = {k: os.environ[k] for k in FORWARDED_BY_DEFAULT if k in os.environ}
        env.update(spec.env)
        fate, output = self._board.start(spec.host, spec.worker_id, spec.command, env, spec.cwd)
        forwarder = LineForwarder(output, prefix, spec.log_file, self._sink, f"agent-output-{spec.worker_id}")  # type: ignore[arg-type]
        forwarder.start()
        return AgentProcess(self._board, spec.worker_id, fate, forwarder, spec.log_file)

    def adopt(self, record: WorkerRecord, prefix: Callable[[], str]) -> AgentProcess:
        """A worker a previous driver started through an agent (``--state-dir``; its record as
        saved): awaited on the board until its agent joins again and lists it."""
        fate, output = self._board.expect(record.slot.host, record.worker_id, record.slot.local_rank, record.keeper_pid)
        log_file = Path(record.log_file) if record.log_file else None
        forwarder = LineForwarder(output, prefix, log_file, self._sink, f"agent-output-{record.worker_id}")  # type: ignore[arg-type]
        forwarder.start()
        return AgentProcess(self._board, record.worker_id, fate, forwarder, log_file)


class AgentProcess:
    """A worker an agent runs, as the driver sees it (``WorkerProcess``)."""

    child_pid = None  # no child of the driver: its exit is seen by ``poll``, each turn
    via_agent = True  # saved with its record: a restarted driver awaits it from its agent

    def __init__(self, board: AgentBoard, worker_id: str, fate: WorkerFate, forwarder: LineForwarder,
                 log_file: Path | None = None) -> None:
        self._board = board
        self.log_file = log_file  # its --log-dir file: saved, so a restarted driver goes on writing it
        self._worker_id = worker_id
        self._fate = fate
        self._forwarder = forwarder

    @property
    def pid(self) -> int:
        return self._fate.pid  # on its host, once the agent said; 0 before

    @property
    def adoptable(self) -> tuple[int, int] | None:
        """(pid, 0) a restarted driver checks the agent's list against, once the agent said."""
        return (self._fate.pid, 0) if self._fate.pid else None

    @property
    def host_gone(self) -> bool:
        """Lost with its agent (``job/exits.py``: not its host's fault, nothing blacklisted)."""
        return self._fate.host_gone

    def poll(self) -> int | None:
        if self._fate.status is None:
            self._board.check(self._worker_id)
        return self._fate.status

    def signal(self, sig: int) -> None:
        self._board.signal(self._worker_id, sig)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def finish_output(self, timeout: float = 5.0) -> None:
        self._forwarder.join(timeout)

    def last_line(self) -> str:
        return self._forwarder.last_line

    def exit_detail(self) -> str:
        return self._fate.detail
