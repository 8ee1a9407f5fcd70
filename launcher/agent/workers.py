"""The workers an agent runs on its machine, and what it has to tell the driver about them.

A worker starts as an ssh-started one does under its supervisor (``node/supervisor.py``):
in a session of its own, dying with the agent (PR_SET_PDEATHSIG: an agent SIGKILLed
takes its workers along), the job secret through an inherited pipe, the collectives on
the interface that reaches the driver. Its output and exit become numbered events
(``protocol.AgentEvent``) that the agent's reporter sends, in order, until the driver
acknowledged them.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import json
import os
import signal
import subprocess
import threading

from lightning_elastic import protocol as p
from lightning_elastic.launcher.hosts.network import collective_interface_env
from lightning_elastic.launcher.node.spawn import end_leftovers_at_exit, signal_group, spawn_worker
from lightning_elastic.launcher.processes.warm_start import SERVER_MODULE
from lightning_elastic.launcher.secret_source import ENV_SECRET

OUTPUT_CHUNK = 4096  # bytes of output per event: many events fit one report
REPORT_BYTES = 48 * 1024  # the most event text one report carries (the service takes 64 KiB)
OUTPUT_AFTER_EXIT = 2.0  # how long the output of an exited worker may still take to drain
# A worker's output the driver has not acknowledged yet (it is unreachable, or slower than
# the worker prints): past this its newest output is dropped, and the stream says how much
# where the gap is, rather than the agent's memory growing with the worker's output.
OUTPUT_PENDING = 4 * 1024 * 1024


class Events:
    """Numbered events waiting for the driver's acknowledgement (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[p.AgentEvent] = []
        self._next = 1
        # Bumped by ``restart`` (a join to a new driver numbers the events afresh): an
        # acknowledgement of the previous numbering, late, must not take the new one's events.
        self.generation = 0
        self._output_held: dict[str, int] = {}  # worker id -> output characters pending
        self._gaps: dict[str, int] = {}  # worker id -> output bytes dropped, not said yet
        self._mid_line: set[str] = set()  # workers whose last output kept ended mid-line

    def add(self, kind: p.AgentEventKind, worker_id: str, **fields: object) -> None:
        with self._cond:
            if kind is p.AgentEventKind.OUTPUT:
                output = str(fields["output"])
                held = self._output_held.get(worker_id, 0)
                if held + len(output) > OUTPUT_PENDING:
                    self._gaps[worker_id] = self._gaps.get(worker_id, 0) + len(output.encode(errors="replace"))
                    return
                output = self._gap_said(worker_id) + output
                fields["output"] = output
                self._output_held[worker_id] = held + len(output)
                if output.endswith("\n"):
                    self._mid_line.discard(worker_id)
                else:
                    self._mid_line.add(worker_id)
            elif kind is p.AgentEventKind.EXITED:
                if worker_id in self._gaps:
                    self._append(p.AgentEventKind.OUTPUT, worker_id, output=self._gap_said(worker_id))
                self._mid_line.discard(worker_id)
            self._append(kind, worker_id, **fields)

    def _gap_said(self, worker_id: str) -> str:
        dropped = self._gaps.pop(worker_id, 0)
        if not dropped:
            return ""
        start = "\n" if worker_id in self._mid_line else ""  # the line on its own
        return f"{start}[{dropped} bytes of output dropped: more than {OUTPUT_PENDING >> 20} MiB of it not yet taken by the driver]\n"

    def _append(self, kind: p.AgentEventKind, worker_id: str, **fields: object) -> None:
        self._pending.append(p.AgentEvent(self._next, kind, worker_id, **fields))  # type: ignore[arg-type]
        self._next += 1
        self._cond.notify_all()

    def batch(self, timeout: float) -> tuple[p.AgentEvent, ...]:
        """The oldest unacknowledged events that fit one report; () after ``timeout`` with none."""
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout)
            batch, size = [], 0
            for event in self._pending:
                size += len(json.dumps(event.output)) + 256
                if batch and size > REPORT_BYTES:
                    break
                batch.append(event)
            return tuple(batch)

    def restart(self, keep: frozenset[str] | set[str]) -> None:
        """A new driver (a join after its restart): the events not yet acknowledged of the
        workers it adopted (``keep``: their output and exits meanwhile) numbered from 1 for
        it, every other one dropped (their workers are stopped, or were never its)."""
        with self._cond:
            kept = [e for e in self._pending if e.worker_id in keep]
            for event in self._pending:
                if event.worker_id not in keep:
                    self._output_held.pop(event.worker_id, None)
                    self._gaps.pop(event.worker_id, None)
                    self._mid_line.discard(event.worker_id)
            self._pending = [dataclasses.replace(e, number=n) for n, e in enumerate(kept, 1)]
            self._next = len(self._pending) + 1
            self.generation += 1
            self._cond.notify_all()

    def acknowledged(self, through: int, generation: int | None = None) -> None:
        with self._cond:
            if generation is not None and generation != self.generation:
                return  # the previous driver's numbering (its reporter's late reply)
            for event in self._pending:
                if event.number > through:
                    break
                if event.kind is p.AgentEventKind.OUTPUT:
                    left = self._output_held.get(event.worker_id, 0) - len(event.output)
                    if left > 0:
                        self._output_held[event.worker_id] = left
                    else:
                        self._output_held.pop(event.worker_id, None)
            self._pending = [e for e in self._pending if e.number > through]
            self._cond.notify_all()

    def drained(self, timeout: float) -> bool:
        """Wait until every event was acknowledged (bounded)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


# Workers that ended, remembered (bounded) with their status so that an agent joining a
# restarted driver can say how the ones that ended while it had no driver ended.
ENDED_KEPT = 256


@dataclasses.dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    output: threading.Thread
    # The host's --preload fork server (launcher/processes/warm_start.py), started by the
    # driver as a worker: no worker of the job, it serves them and ends after them.
    server: bool = False


def is_fork_server(command: tuple[str, ...]) -> bool:
    return command[1:3] == ("-m", SERVER_MODULE)


class Workers:
    """The agent's workers, by worker id (thread-safe)."""

    def __init__(self, secret: str, events: Events) -> None:
        self._secret = secret
        self._events = events
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._ended = threading.Condition(self._lock)
        self._exits: collections.OrderedDict[str, p.AgentWorker] = collections.OrderedDict()  # ENDED_KEPT

    def held(self) -> tuple[p.AgentWorker, ...]:
        """The job's workers here, running and recently ended (with their status): what a
        join to a restarted driver lists for it to adopt. Fork servers are none of them."""
        with self._lock:
            running = [p.AgentWorker(worker_id, r.proc.pid) for worker_id, r in self._running.items()
                       if not r.server]
            return (*running, *(w for w in self._exits.values() if w.worker_id not in self._running))

    def kill_except(self, keep: frozenset[str] | set[str]) -> int:
        """SIGKILL every worker not in ``keep`` (a fork server: SIGTERM, as ``kill_all``):
        the driver did not adopt them. How many were signalled."""
        killed = 0
        with self._lock:
            for worker_id, running in self._running.items():
                if worker_id not in keep and not running.server:
                    signal_group(running.proc.pid, signal.SIGKILL)
                    killed += 1
        return killed

    def live(self) -> int:
        """The job's workers running here (a fork server is none: ``end_servers``)."""
        with self._lock:
            return sum(not running.server for running in self._running.values())

    def end_servers(self) -> None:
        """SIGTERM the fork servers (each removes its directory), once no worker needs them."""
        with self._lock:
            for running in self._running.values():
                if running.server:
                    signal_group(running.proc.pid, signal.SIGTERM)

    def start(self, order: p.AgentOrder) -> None:
        worker_id = order.worker_id
        env = {k: v for k, v in os.environ.items() if k != ENV_SECRET}
        env.update(entry.split("=", 1) for entry in order.env if "=" in entry)  # type: ignore[arg-type]
        if "MASTER_ADDR" in env:  # collectives go out through the interface that reaches the driver
            env.update(collective_interface_env(env, env["MASTER_ADDR"]))
        # The driver's directory when this machine has it (shared paths, one image), else ours.
        cwd = order.cwd if order.cwd and os.path.isdir(order.cwd) else os.getcwd()
        with self._lock:
            if worker_id in self._running:
                return  # (an order is carried out once; a repeated id is the driver's bug)
            try:
                proc = spawn_worker(order.command, env, self._secret, cwd, subprocess.PIPE, p.ENV_SECRET_FD)
            except (OSError, ValueError) as err:
                why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                self._events.add(p.AgentEventKind.NOT_STARTED, worker_id,
                                 detail=p.clip(f"cannot start {order.command[0] if order.command else '?'!r}: {why}",
                                               300))
                return
            self._events.add(p.AgentEventKind.STARTED, worker_id, pid=proc.pid)
            output = threading.Thread(target=self._forward, args=(worker_id, proc), name=f"output-{proc.pid}",
                                      daemon=True)
            self._running[worker_id] = _Running(proc, output, is_fork_server(order.command))
        output.start()
        threading.Thread(target=self._reap, args=(worker_id, proc, output), name=f"reaper-{proc.pid}",
                         daemon=True).start()

    def signal(self, worker_id: str, sig: int) -> None:
        with self._lock:
            running = self._running.get(worker_id)
            if running is not None:
                signal_group(running.proc.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every worker (the driver lost this agent, or it gave up on the driver). A
        fork server gets SIGTERM: it has no state to lose, and ends removing its directory
        (its forks die with it); ``force_all`` if it has not ended after a grace."""
        with self._lock:
            for running in self._running.values():
                signal_group(running.proc.pid, signal.SIGTERM if running.server else signal.SIGKILL)

    def force_all(self) -> None:
        """SIGKILL everything still running, fork servers included."""
        with self._lock:
            for running in self._running.values():
                signal_group(running.proc.pid, signal.SIGKILL)

    def signal_all(self, sig: int) -> None:
        with self._lock:
            for running in self._running.values():
                signal_group(running.proc.pid, sig)

    def wait_all(self, timeout: float) -> bool:
        """Until every worker has ended (bounded); True if they have."""
        with self._ended:
            return self._ended.wait_for(lambda: not self._running, timeout)

    def _forward(self, worker_id: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while chunk := proc.stdout.read1(OUTPUT_CHUNK):
                text = decoder.decode(chunk)
                if text:
                    self._events.add(p.AgentEventKind.OUTPUT, worker_id, output=text)
            rest = decoder.decode(b"", final=True)
            if rest:
                self._events.add(p.AgentEventKind.OUTPUT, worker_id, output=rest)
        except OSError:
            pass
        finally:
            proc.stdout.close()

    def _reap(self, worker_id: str, proc: subprocess.Popen[bytes], output: threading.Thread) -> None:
        end_leftovers_at_exit(proc.pid)  # what it left in its group ends with it
        status = proc.wait()
        output.join(OUTPUT_AFTER_EXIT)  # its last lines before its exit
        self._events.add(p.AgentEventKind.EXITED, worker_id, status=max(status, 0), signal=max(-status, 0))
        with self._ended:
            running = self._running.pop(worker_id, None)
            if running is not None and not running.server:
                self._exits[worker_id] = p.AgentWorker(worker_id, proc.pid, running=False, status=max(status, 0),
                                                       signal=max(-status, 0))
                while len(self._exits) > ENDED_KEPT:
                    self._exits.popitem(last=False)
            self._ended.notify_all()
