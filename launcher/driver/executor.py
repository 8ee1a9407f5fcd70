"""Performing the core's effects (``job/effects.py``), in the order the step gave them.

Under the job's lock, at once: wakes and the loop's notification (the registry), log lines
and timeline events (each through a background writer: the loop never waits on a disk or
a terminal), signals to worker processes. Starts and fork-server preparations are only
queued here: ``WorkerStarts._start_pending`` runs them after the lock is released.
"""

from __future__ import annotations

import logging

from lightning_elastic.launcher.driver.starts import _PendingStart, _prefix_of
from lightning_elastic.launcher.job.effects import (
    Announced,
    Changed,
    Effects,
    Emit,
    End,
    Log,
    PrepareHost,
    RoundFormed,
    Signal,
    Start,
    Wake,
    WakeLive,
)
from lightning_elastic.launcher.job.verdict import Verdict

log = logging.getLogger("lightning_elastic.driver")

# What the registry performs itself (it is what the service's transitions produce too).
IN_MEMORY = (Wake, WakeLive, Changed, Log)


class Executor:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _perform(self, fx: Effects) -> Verdict | None:
        """Perform ``fx``; the verdict of an ``End`` among them, else None. Once the job has
        ended, the workers planned in the same step are never started."""
        verdict = None
        memory = Effects()
        for effect in fx:
            kind = type(effect)
            if kind in IN_MEMORY:
                memory.add(effect)
                continue
            self._registry.perform(memory)  # in order with what follows
            memory = Effects()
            if kind is Signal:
                proc = self._processes.get(effect.worker_id)
                if proc is not None:
                    for sig in effect.signals:
                        proc.signal(sig)
            elif kind is Emit:
                self._events.emit(effect.kind, **effect.fields)
            elif kind is Announced:
                self._events.host_change_announced(effect.round, effect.generation)
            elif kind is RoundFormed:
                self._gc.round_formed()
                self._events.round_formed(effect.number, list(effect.members))
                for worker_id in effect.forgotten:
                    # Its process was reaped; its output may still be draining: flushed at the end.
                    proc = self._processes.pop(worker_id, None)
                    if proc is not None:
                        self._retired.append(proc)
            elif kind is Start:
                record = self._state.workers[effect.worker_id]
                self._pending_starts.append(_PendingStart(record, self._spec_for(effect), _prefix_of(record)))
            elif kind is PrepareHost:
                self._pending_prepares.append(self._fork_server_spec(effect.host))
            elif kind is End:
                verdict = effect.verdict if verdict is None else verdict
            else:  # a bug: an effect nobody performs would be lost silently
                raise TypeError(f"the driver cannot perform {effect!r}")
        self._registry.perform(memory)
        if verdict is not None:
            self._pending_starts.clear()
            self._pending_prepares.clear()
        return verdict
