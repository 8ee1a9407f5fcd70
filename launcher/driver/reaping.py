"""What the loop observes of its workers' processes each turn: the exits (classified by the
core, ``job/exits.py``), and its own turns (``job/liveness.py``'s absences)."""

from __future__ import annotations

import logging

from lightning_elastic.launcher.job.step import Exited

log = logging.getLogger("lightning_elastic.driver")


class Reaping:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _turn(self, now: float) -> None:
        """The loop turned (or started a worker: busy, not away)."""
        away = self._state.absences.turn(now)
        if away > self._config.timeouts.heartbeat_timeout:
            log.warning("The driver did not run for %.1f s (stopped, suspended or starved of CPU): every worker's "
                        "heartbeat timeout starts again now.", away)

    def _poll_exits(self) -> tuple[Exited, ...]:
        """The live workers whose process has ended since the last turn (O(N) polls, no
        system call for a local child: its exit was recorded by the exit watcher or wait).

        A worker that failed before it ever joined comes with its last output line (an
        import error's, say): its output is awaited first, all such workers' together for
        at most ``Timeouts.last_output``.
        """
        exits = []
        processes = self._processes
        deadline: float | None = None
        for record in self._state.live_workers():
            proc = processes[record.worker_id]
            status = proc.poll()
            if status is None:
                continue
            last_line = ""
            if status != 0 and not record.joined:
                if deadline is None:
                    deadline = self._clock() + self._config.timeouts.last_output
                proc.finish_output(max(0.0, deadline - self._clock()))
                last_line = proc.last_line()
            exits.append(Exited(record.worker_id, status, proc.exit_detail(), last_line,
                                getattr(proc, "host_gone", False)))
        return tuple(exits)
