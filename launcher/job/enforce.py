"""What the driver enforces on workers: stopping one, killing a wedged one, and the time
rules (``job/liveness.py``: heartbeats, start-up, return after a reset, --exit-timeout).

Each changes the ``JobState`` and appends the signals, wakes and log lines to ``fx``.
"""

from __future__ import annotations

import signal

from lightning_elastic.launcher.job import rounds
from lightning_elastic.launcher.job.effects import Effects
from lightning_elastic.launcher.job.liveness import WorkerClock, exit_overdue, wedged
from lightning_elastic.launcher.job.rules import Rules
from lightning_elastic.launcher.job.state import JobState, WorkerRecord, WorkerState


def check_time(state: JobState, now: float, rules: Rules, fx: Effects) -> None:
    """The rules that fire on time alone: wedged workers, and --exit-timeout once training
    has returned (O(N), no views built: cheap at any N)."""
    _kill_wedged(state, now, rules, fx)
    _enforce_exit_timeout(state, now, rules, fx)


def stop_worker(state: JobState, record: WorkerRecord, why: str, now: float, rules: Rules, fx: Effects) -> None:
    """SIGTERM (and SIGCONT: a stopped process sees SIGTERM only once continued), SIGKILL at
    --stop-grace; a rendezvous it waits in answers EXIT now."""
    if record.stopping or record.state.finished:
        return
    fx.info("Stopping worker %s: %s.", record.worker_id, why)
    record.leave = True
    fx.changed()
    fx.wake(record.worker_id)
    fx.signal(record.worker_id, signal.SIGTERM, signal.SIGCONT)
    record.stop_deadline = now + rules.config.timeouts.stop_grace


def _kill(state: JobState, record: WorkerRecord, why: str, now: float, rules: Rules, fx: Effects) -> None:
    """SIGKILL a wedged worker: its peers then fail promptly instead of at a timeout."""
    fx.warning("Killing worker %s: %s.", record.worker_id, why)
    record.kill_reason = why
    fx.changed()
    fx.signal(record.worker_id, signal.SIGKILL)
    record.stop_deadline = now + rules.config.timeouts.stop_grace
    if state.current_member(record) and not state.finishing():
        # Its peers learn at once, not when the kill has been reaped.
        rounds.mark_round_broken(state, state.round.number, f"worker {record.worker_id} was killed: {why}", fx,  # type: ignore[union-attr]
                                 repeated_error_limit=rules.config.repeated_error_limit)


def _kill_wedged(state: JobState, now: float, rules: Rules, fx: Effects) -> None:
    round_broken = state.round_broken()
    timeouts, absences, since = rules.config.timeouts, state.absences, state.reset_pending_since
    for record in state.live_workers():
        if record.stopping:
            continue
        report = record.report
        why = wedged(WorkerClock(record.started_at, record.last_heartbeat, record.reported_at,
                                 report.outcome.value if report else "", record.state is WorkerState.MEMBER),
                     now, absences, timeouts, since, round_broken)
        if why is not None:
            _kill(state, record, why, now, rules, fx)


def _enforce_exit_timeout(state: JobState, now: float, rules: Rules, fx: Effects) -> None:
    """Training returned and a worker exited: the others get --exit-timeout to follow."""
    why = exit_overdue(state.first_exit, now, state.absences, rules.config.timeouts)
    if why is None:
        return
    for record in state.live_workers():
        if not record.stopping:
            record.kill_reason = why  # counted as failed when reaped
            stop_worker(state, record, why, now, rules, fx)
