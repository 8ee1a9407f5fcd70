"""``--state-dir`` from the driver's side: saving the job's state, paced by its cost, and
adopting the job a previous driver left."""

from __future__ import annotations

import logging
import time

from lightning_elastic.launcher.driver.starts import _prefix_of
from lightning_elastic.launcher.restart import adoption, state_codec

log = logging.getLogger("lightning_elastic.driver")


class Keeping:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _save_state_when_due(self, now: float) -> None:
        """Save what decision passes changed, paced by the save's cost (``SavePacing``)."""
        if self._keeping is None:
            return
        key = self._state.round_key()
        if self._save_pacing.due(now, key):
            started = time.perf_counter()
            self._save_state()
            cost = time.perf_counter() - started + self._keeping.writer.last_write_s
            self._save_pacing.saved(now, key, cost)

    def _save_state(self) -> None:
        """Hand the job's state to the writer thread: captured under the lock (a copy of the
        records, ~1 µs each), encoded and written by the writer thread."""
        if self._keeping is None or self._server is None:
            return
        state = self._state
        state.address, state.port = self._address, self._server.port  # where the workers look first
        self._learn_processes()
        self._keeping.writer.submit(state_codec.capture(state), self._clock())

    def _learn_processes(self) -> None:
        """Copy into each live worker's record what a restarted driver finds its process by
        (``adoptable``: the keeper's pid and start ticks; ssh learns them when the supervisor
        says, after the start) and its --log-dir file, once known. O(live workers)."""
        processes = self._processes
        for record in self._state.workers.values():
            if record.keeper_pid or record.state.finished:
                continue
            proc = processes.get(record.worker_id)
            if getattr(proc, "via_agent", False):  # saved before its agent said its pid, too
                record.via_agent = True
            found = getattr(proc, "adoptable", None)
            if found:
                record.keeper_pid, record.start_ticks = found
                log_file = getattr(proc, "log_file", None)
                record.log_file = str(log_file) if log_file else ""

    def _adopt_address(self) -> None:
        """Serve where the previous driver did, if this machine has its address."""
        keeping = self._keeping
        assert keeping is not None and keeping.previous is not None
        state = keeping.previous
        if self._address != state.address:
            if self._is_local(state.address):
                log.info("Serving on %s, as the previous driver did (not %s): its workers look for it there.",
                         state.address, self._address)
                self._address = state.address
            else:  # another machine: the workers follow the address this driver writes
                log.info("Serving on %s: the previous driver's address %s is not one of this machine's; its "
                         "workers find this driver through %s.", self._address, state.address,
                         keeping.dir.url_file)

    def _adopt(self) -> None:
        """Take over the job a previous driver left in the state dir: its workers, its
        round (not re-formed), its blacklist and counters."""
        keeping = self._keeping
        assert keeping is not None and keeping.previous is not None
        started = time.perf_counter()
        with self._registry.cond:
            # The saved JobState becomes this driver's (spares stay spares, a preempted slot
            # keeps the rest of its hold, the workers after training returned the rest of
            # their --exit-timeout), under the adoption rules (restart/adoption.py).
            restored = adoption.restore(keeping.previous, self._registry, keeping.adopt,  # type: ignore[arg-type]
                                        _prefix_of, self._clock())
            keeping.previous = None  # part of this driver's state now
            current = self._state.round
            # What is on disk is what was just restored: the next save waits its window (as
            # after a save as costly), not the adopted fleet's first requests, the service's
            # busiest moment after a restart.
            self._save_pacing.saved(self._clock(), self._state.round_key(), time.perf_counter() - started)
        self._processes.update(restored.processes)
        round_number = current.number if current else 0
        line = (f"driver restarted after {keeping.outage:.1f} s without one: adopted {restored.adopted} "
                f"worker(s) in round {round_number}"
                + (f"; {restored.ended} ended while no driver ran" if restored.ended else ""))
        self._state.tally.outages.append(line)
        log.info("Adopting the job in %s: %s.", keeping.dir.path, line)
        self._adoption_watch = adoption.AdoptionWatch(
            [self._state.workers[w] for w, proc in restored.processes.items() if proc.poll() is None],
            self._clock(), self._started_at)
        self._events.resume(round_number)
        self._events.emit("driver_restarted", outage_s=round(keeping.outage, 3), adopted=restored.adopted,
                          ended=restored.ended, round=round_number)

    def _adoption_progress(self, now: float) -> None:
        took = self._adoption_watch.check(now)  # type: ignore[union-attr]
        if took is not None:
            self._adoption_watch = None
            log.info("Every adopted worker reached this driver %.2f s after its start.", took)
            self._events.emit("workers_adopted", after_s=round(took, 3))
