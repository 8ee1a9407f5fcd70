"""Exits and hangs: the reaper turns each exit into what ``job/exits.py`` says it means, and
the wedge check kills what ``job/liveness.py`` says is hung."""

from __future__ import annotations

import logging
import signal

from lightning_elastic.launcher.job.exits import ExitFacts, ExitKind, classify_exit
from lightning_elastic.launcher.job.liveness import WorkerClock, exit_overdue, wedged
from lightning_elastic.launcher.job.state import WorkerRecord, WorkerState

log = logging.getLogger("lightning_elastic.driver")


class Reaping:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _turn(self, now: float) -> None:
        away = self._absences.turn(now)
        if away > self._config.timeouts.heartbeat_timeout:
            log.warning("The driver did not run for %.1f s (stopped, suspended or starved of CPU): every worker's "
                        "heartbeat timeout starts again now.", away)

    def _reap(self, now: float) -> bool:
        """Record the workers that exited (and SIGKILL those past their stop deadline);
        True if any exited."""
        reg = self._registry
        reaped = False
        for record in reg.live_workers():
            proc = self._processes[record.worker_id]
            status = proc.poll()
            if status is None:
                deadline = record.stop_deadline
                if deadline is not None and now >= deadline:
                    proc.signal(signal.SIGKILL)
                continue
            reaped = True
            record.exit_status = status
            finishing = self._finishing()
            report = record.report
            verdict = classify_exit(ExitFacts(
                record.worker_id, status, proc.exit_detail(), report.outcome if report else None,
                report.message if report else "", record.joined, record.leave, record.departing,
                record.kill_reason, reg.current_member(record), finishing))
            if verdict.kind is ExitKind.DONE:
                record.state = WorkerState.DONE
                log.info("Worker %s finished training and exited.", record.worker_id)
                self._events.emit("worker_done", worker=record.worker_id, host=record.slot.host)
            elif verdict.kind is ExitKind.LEFT:
                record.state = WorkerState.REMOVED
                if record.departing:
                    self._state.tally.departures.append(f"worker {record.worker_id} left on {record.departing}")
                    self._state.held_until[record.slot] = now + self._config.timeouts.preemption_grace
                    log.info("Worker %s left the job on %s; host %s stays usable.",
                             record.worker_id, record.departing, record.slot.host)
                    self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host,
                                      reason=f"left on {record.departing}")
                else:
                    log.info("Worker %s left the job (exit status %d).", record.worker_id, status)
                    self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host,
                                      reason="removed from the job")
            elif verdict.kind is ExitKind.STOPPED:
                record.state = WorkerState.REMOVED
                log.info("Worker %s left the job (exit status %d).", record.worker_id, status)
                self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host, reason="stopped")
                if verdict.break_round:
                    reg.mark_round_broken(reg.state.round.number, f"worker {record.worker_id} was stopped")  # type: ignore[union-attr]
            else:
                self._fail(record, verdict.failure, verdict.break_round, verdict.blacklist, verdict.host_failed,
                           verdict.never_joined)
            if finishing and self._state.first_exit is None:
                self._state.first_exit = (now, record.worker_id)
            reg.wake(record)  # its requests still waiting must end
        return reaped

    def _finishing(self) -> bool:
        """Has training returned in the current round (some member reported DONE)?"""
        current = self._registry.state.round
        return current is not None and any(self._registry.state.workers[w].reported_done for w in current.members)

    def _fail(self, record: WorkerRecord, text: str, break_round: bool, blacklist: bool, host_failed: bool,
              never_joined: bool) -> None:
        record.state = WorkerState.FAILED
        if never_joined and not self._state.never_joined:
            self._state.never_joined = text
        record.failure = text
        self._state.tally.failures.append(text)
        log.warning("%s.", text[:1].upper() + text[1:])
        self._events.emit("worker_failed", worker=record.worker_id, host=record.slot.host, reason=text)
        round_ = self._registry.state.round
        if break_round and round_ is not None:
            self._registry.mark_round_broken(round_.number, text)
        host = record.slot.host
        if not blacklist:
            return  # training is over: nothing more to run on any host
        if not self._state.hosts.is_blacklisted(host):
            # A slot, or the whole host when the failure says the machine is bad (see
            # HostManager.record_failure): a sibling's death never stops healthy workers.
            taken = self._state.hosts.record_failure(record.slot, host_failed=host_failed)
            if taken.name not in self._state.tally.blacklisted:
                self._state.tally.blacklisted.append(taken.name)
            if taken.whole_host:
                self._events.emit("host_blacklisted", host=host, reason=text)
                log.warning("Blacklisted host %s %s: %s.", host, taken.describe(), taken.why)
            else:
                self._events.emit("slot_blacklisted", host=host, slot=taken.name, reason=text)
                log.warning("Blacklisted slot %s %s: %s.", taken.name, taken.describe(), taken.why)
                return
        for other in self._registry.live_workers():
            if other.slot.host == host:
                self._stop_worker(other, f"its host {host} is blacklisted")

    def _enforce_exit_timeout(self, now: float) -> None:
        """Training returned and a worker exited: the others get --exit-timeout to follow."""
        why = exit_overdue(self._state.first_exit, now, self._absences, self._config.timeouts)
        if why is None:
            return
        for record in self._registry.live_workers():
            if not record.stopping:
                record.kill_reason = why  # counted as failed when reaped
                self._stop_worker(record, why)

    def _kill_wedged(self, now: float) -> None:
        reg = self._registry
        current = reg.state.round
        round_broken = current is not None and current.number in reg.state.broken_rounds
        timeouts, absences, since = self._config.timeouts, self._absences, self._state.reset_pending_since
        for record in reg.live_workers():
            if record.stopping:
                continue
            report = record.report
            why = wedged(WorkerClock(record.started_at, record.last_heartbeat, record.reported_at,
                                     report.outcome.value if report else "", record.state is WorkerState.MEMBER),
                         now, absences, timeouts, since, round_broken)
            if why is not None:
                self._kill(record, why)

    def _kill(self, record: WorkerRecord, why: str) -> None:
        """SIGKILL a wedged worker: its peers then fail promptly instead of at a timeout."""
        log.warning("Killing worker %s: %s.", record.worker_id, why)
        record.kill_reason = why
        self._registry.note_change()
        self._processes[record.worker_id].signal(signal.SIGKILL)
        record.stop_deadline = self._clock() + self._config.timeouts.stop_grace
        reg = self._registry
        if reg.current_member(record) and not self._finishing():
            # Its peers learn at once, not when the kill has been reaped.
            reg.mark_round_broken(reg.state.round.number, f"worker {record.worker_id} was killed: {why}")  # type: ignore[union-attr]
