"""Starting workers: each one's spec and environment, planned in a decision pass under the
job's lock and started after it with the lock released."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

from lightning_elastic import protocol as p
from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.job.effects import Start
from lightning_elastic.launcher.job.state import WorkerRecord, WorkerState
from lightning_elastic.launcher.processes.base import NotStarted, WorkerProcess, WorkerSpec

log = logging.getLogger("lightning_elastic.driver")


# Put first on the workers' PYTHONPATH: lightning_elastic/_autoload/sitecustomize.py.
AUTOLOAD_DIR = Path(p.__file__).resolve().parent / "_autoload"


def worker_pythonpath(given: str | None) -> str:
    """The workers' ``PYTHONPATH``: our autoload folder first, then ``given`` (the driver's
    own, or the one ``-x PYTHONPATH[=VALUE]`` passes), never instead of it.

    The folder's ``sitecustomize`` registers ``strategy="elastic_hvd"`` when the script
    imports Lightning; a ``-x PYTHONPATH`` that replaced it (mpirun's and horovodrun's
    habit of forwarding one's own) silently turned that off.
    """
    ours = str(AUTOLOAD_DIR)
    entries = [entry for entry in (given or "").split(os.pathsep) if entry and entry != ours]
    return os.pathsep.join([ours, *entries])


@dataclasses.dataclass(frozen=True)
class _PendingStart:
    """A worker planned under the registry's lock, started once it is released."""

    record: WorkerRecord
    spec: WorkerSpec
    prefix: Callable[[], str]


def _prefix_of(record: WorkerRecord) -> Callable[[], str]:
    """The prefix of a worker's output lines: its rank in the current round, read per line."""

    def prefix() -> str:
        rank = record.rank
        return f"[{rank if rank is not None else '-'}] "

    return prefix


class WorkerStarts:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _spec_for(self, start: Start) -> WorkerSpec:
        """How to start the worker the core planned: its command, environment and log file."""
        assert self._server is not None
        slot, worker_id = start.slot, start.worker_id
        env = {
            **self._job_env(),
            p.ENV_WORKER_ID: worker_id,
            p.ENV_HOSTNAME: slot.slot.host,
            # The usual torch variables, as planned; le.init() updates them every round.
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(slot.size),
            "LOCAL_RANK": str(slot.slot.local_rank),
            "LOCAL_WORLD_SIZE": str(slot.local_size),
            "GROUP_RANK": str(slot.cross_rank),
            "MASTER_ADDR": self._address,
            "MASTER_PORT": str(self._server.port),
        }
        log_file = None
        if self._config.log_dir is not None:
            log_file = self._config.log_dir / f"worker-{start.number}-{slot.slot.host}-{slot.slot.local_rank}.log"
        return WorkerSpec(worker_id=worker_id, host=slot.slot.host, command=self._config.command, env=env,
                          secret=self._secret, cwd=os.getcwd(), log_file=log_file)

    def _job_env(self) -> dict[str, str]:
        """The variables every worker of the job gets (``_spawn`` adds each one's own)."""
        assert self._server is not None
        t = self._config.timeouts
        given = dict(self._config.env)  # -x: the user's variables
        # Our sitecustomize first, then the driver's PYTHONPATH or the one -x gives.
        pythonpath = worker_pythonpath(given.pop("PYTHONPATH", os.environ.get("PYTHONPATH")))
        return {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # several workers per host would thrash
            "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),
            **given,
            "PYTHONPATH": pythonpath,
            p.ENV_DRIVER_URL: self._server.url,
            p.ENV_HEARTBEAT_INTERVAL: str(t.heartbeat_period),
            p.ENV_HEARTBEAT_TIMEOUT: str(t.heartbeat_timeout),
            p.ENV_ELASTIC_TIMEOUT: str(self._config.elastic_timeout),
            p.ENV_LOST_MEMBER_WAIT: str(t.lost_member_wait),
            p.ENV_PROCESS_GROUP_TIMEOUT: str(t.process_group),
            p.ENV_PREEMPTION_GRACE: str(t.preemption_grace),
            **(self._resume.env if self._resume else {}),
            **({p.ENV_DRIVER_PATIENCE: str(self._config.driver_patience),
                p.ENV_DRIVER_URL_FILE: str(self._keeping.dir.url_file)} if self._keeping is not None else {}),
        }

    def _fork_server_spec(self, host: str) -> WorkerSpec:
        """``--preload``: how to start ``host``'s fork server (as a worker is started there)."""
        return WorkerSpec(worker_id=f"fork server on {host}", host=host, command=self._config.command,
                          env=self._job_env(), secret=self._secret, cwd=os.getcwd())

    def _start_pending(self) -> None:
        """Start the workers the last pass planned, with the registry's lock released.

        A process start takes ~20 ms here (an ssh client's more, 4,096 of them minutes), and
        every request of the rendezvous service takes that lock: heartbeats are answered
        meanwhile. Nothing else changes hands: only this thread starts, reaps or signals
        workers, and a worker cannot ask the service about itself before it exists.
        """
        pending, self._pending_starts = self._pending_starts, []
        prepares, self._pending_prepares = self._pending_prepares, []
        if not pending and not prepares:
            return
        started: list[tuple[_PendingStart, WorkerProcess]] = []
        failed: StartError | None = None
        self._registry.cond.release()
        try:
            for item in pending:
                try:
                    if item.spec.log_file is not None:
                        item.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
                    proc: WorkerProcess = self._launcher.start(item.spec, item.prefix)
                except OSError as err:
                    # This machine's disk (--state-dir, --log-dir) failed this start: ENOSPC, EIO.
                    # That slot's failure, reaped next turn; never the job's.
                    where = f" ({err.filename})" if err.filename else ""
                    proc = NotStarted(f"could not be started: {err.strerror or err}{where}")
                started.append((item, proc))
                self._turn(self._clock())  # busy, not away: minutes of starts are no pause
            for spec in prepares:  # after the workers: a fork server no worker waits for yet
                self._prepare(spec)  # type: ignore[misc]  # (set whenever prepares are queued)
                self._turn(self._clock())
        except StartError as err:
            failed = err
        finally:
            self._registry.cond.acquire()
            for item, proc in started:  # whatever else failed: every started process is known
                self._started(item.record, proc)
        if failed is not None:
            # The same command (or ssh) fails for every slot of this kind: the job cannot run.
            for item in pending[len(started):]:
                item.record.state = WorkerState.FAILED
            raise failed

    def _started(self, record: WorkerRecord, proc: WorkerProcess) -> None:
        worker_id = record.worker_id
        self._processes[worker_id] = proc
        if isinstance(proc, NotStarted):
            return  # said as its failure when reaped
        log.info("Started worker %s%s.", worker_id, f" (pid {proc.pid})" if proc.pid else "")
        self._events.emit("worker_started", worker=worker_id, host=record.slot.host, pid=proc.pid)
        child = getattr(proc, "child_pid", None)  # test doubles may have none
        if child is not None and self._exit_watcher is not None:
            self._exit_watcher.watch(child)
