"""The driver's rules as one step: ``step(state, turn, rules) -> Effects``.

Each turn of the decision loop hands the step what the shell observed (``Turn``: the time,
the workers that exited, discovery's newest hosts, whether the service recorded something
that needs a decision) and performs the effects it returns. The step changes only the
``JobState``; it reads no clock (time is ``turn.now``), signals no process and does no I/O.
Its order within a turn, which matters:

1. the observations: hosts listed (order, blacklist cooldowns), exits classified
   (``job/exits.py``): a failure breaks its round and blacklists its slot or host, and the
   blacklisted host's other workers are stopped; workers past their stop deadline are
   SIGKILLed;
2. when something changed, or a timer is due and a decision waits on time: one decision
   pass (``job/decide.py``): wedged workers killed, the verdict, the plan, the
   announcement, the next round;
3. otherwise, when a timer is due: only the time rules (wedged workers, --exit-timeout).

Tested without processes or sockets (tests/unit/launcher/job/test_step.py).
"""

from __future__ import annotations

import dataclasses
import signal

from lightning_elastic.launcher.job import decide, rounds
from lightning_elastic.launcher.job.effects import Effects
from lightning_elastic.launcher.job.enforce import check_time, stop_worker
from lightning_elastic.launcher.job.exits import ExitFacts, ExitKind, classify_exit
from lightning_elastic.launcher.job.rules import Rules
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.job.state import JobState, WorkerRecord, WorkerState
from lightning_elastic.protocol import EXIT_DRIVER_GONE


@dataclasses.dataclass(frozen=True)
class Exited:
    """A worker's process ended with ``status``; ``detail``: the launcher's word that the
    host itself failed (ssh lost it, its node died), "" for a plain exit."""

    worker_id: str
    status: int
    detail: str = ""
    last_line: str = ""  # its last output line, for a worker that failed before it joined
    host_gone: bool = False  # lost with its host's agent: nothing to blacklist (job/exits.py)


@dataclasses.dataclass(frozen=True)
class HostsListed:
    """Discovery's newest result, with the hosts the driver cannot use already left out."""

    hosts: tuple[HostSlots, ...] | None  # None: the poll failed
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one turn of the loop observed."""

    now: float
    exits: tuple[Exited, ...] = ()
    listed: HostsListed | None = None  # a new discovery result, if there is one
    requests_changed: bool = False  # the service recorded something a decision waits for
    timer_due: bool = False  # the loop's pacing: time rules may fire now


@dataclasses.dataclass
class StepResult:
    effects: Effects
    observed_change: bool  # the hosts or a worker's fate changed this turn
    decided: bool  # a decision pass ran


def step(state: JobState, turn: Turn, rules: Rules) -> StepResult:
    """One turn of the driver's rules (see the module docstring)."""
    fx = Effects()
    now = turn.now
    changed = _take_hosts(state, turn.listed, fx)
    changed = bool(state.hosts.tick()) or changed  # (HostManager reads the same clock, injected)
    changed = _reap(state, turn.exits, now, rules, fx) or changed
    if changed or turn.requests_changed or (turn.timer_due and timers_pending(state, now)):
        verdict = decide.decision_pass(state, now, rules, fx)
        if verdict is not None:
            fx.end(verdict)
        return StepResult(fx, changed, True)
    if turn.timer_due:
        check_time(state, now, rules, fx)
    return StepResult(fx, changed, False)


def timers_pending(state: JobState, now: float) -> bool:
    """Does a decision depend on time alone now (the elastic timeout while slots are
    missing, a preempted slot's hold or its end)? Otherwise an unchanged job needs none."""
    ended = [slot for slot, until in state.held_until.items() if until <= now]
    for slot in ended:
        del state.held_until[slot]
    return state.below_since is not None or bool(state.held_until) or bool(ended)


# ----- observations --------------------------------------------------------------------

def _take_hosts(state: JobState, listed: HostsListed | None, fx: Effects) -> bool:
    """Apply discovery's newest result; True when the hosts or its error changed (a poll that
    found the same hosts, every few seconds, needs no decision)."""
    if listed is None:
        return False
    error_changed = listed.error != state.discovery_error
    state.discovery_error = listed.error
    if listed.hosts is None:
        return error_changed
    change = state.hosts.update(list(listed.hosts))
    if change:
        fx.info("Hosts changed: added %s, removed %s, resized %s.",
                list(change.added), list(change.removed), list(change.resized))
        fx.emit("hosts_changed", added=list(change.added), removed=list(change.removed))
    return bool(change) or error_changed


def _reap(state: JobState, exits: tuple[Exited, ...], now: float, rules: Rules, fx: Effects) -> bool:
    """Classify each exit and apply what it means; SIGKILL workers past their stop deadline.
    True if any worker exited."""
    for exited in exits:
        record = state.workers.get(exited.worker_id)
        if record is None or record.state.finished:
            continue
        _apply_exit(state, record, exited, now, rules, fx)
    exited_ids = {e.worker_id for e in exits}
    for record in state.workers.values():  # every turn: no list built
        deadline = record.stop_deadline
        if (deadline is not None and now >= deadline and not record.state.finished
                and record.worker_id not in exited_ids):
            fx.signal(record.worker_id, signal.SIGKILL)
    return bool(exits)


def _apply_exit(state: JobState, record: WorkerRecord, exited: Exited, now: float, rules: Rules,
                fx: Effects) -> None:
    status = exited.status
    record.exit_status = status
    finishing = state.finishing()
    report = record.report
    verdict = classify_exit(ExitFacts(
        record.worker_id, status, exited.detail, report.outcome if report else None,
        report.message if report else "", record.joined, record.leave, record.departing,
        record.kill_reason, state.current_member(record), finishing,
        gave_up_on_driver=record.adopted and status == EXIT_DRIVER_GONE, last_line=exited.last_line,
        host_gone=exited.host_gone))
    worker, host = record.worker_id, record.slot.host
    if verdict.kind is ExitKind.DONE:
        record.state = WorkerState.DONE
        fx.info("Worker %s finished training and exited.", worker)
        fx.emit("worker_done", worker=worker, host=host)
    elif verdict.kind is ExitKind.LEFT:
        record.state = WorkerState.REMOVED
        if record.departing:
            state.tally.departures.append(f"worker {worker} left on {record.departing}")
            state.held_until[record.slot] = now + rules.config.timeouts.preemption_grace
            fx.info("Worker %s left the job on %s; host %s stays usable.", worker, record.departing, host)
            fx.emit("worker_left", worker=worker, host=host, reason=f"left on {record.departing}")
        else:
            fx.info("Worker %s left the job (exit status %d).", worker, status)
            fx.emit("worker_left", worker=worker, host=host, reason="removed from the job")
    elif verdict.kind is ExitKind.DRIVER_GONE:
        record.state = WorkerState.REMOVED
        fx.info("Worker %s left the job while no driver ran (it waited --driver-patience for one, exit status "
                "%d): not a failure; its slot gets a new worker.", worker, status)
        fx.emit("worker_left", worker=worker, host=host, reason="no driver for its --driver-patience")
        if verdict.break_round and state.round is not None:
            rounds.mark_round_broken(state, state.round.number, f"worker {worker} left while no driver ran", fx,
                                     repeated_error_limit=rules.config.repeated_error_limit)
        _start_afresh_if_every_member_gone(state, fx)
    elif verdict.kind is ExitKind.STOPPED:
        record.state = WorkerState.REMOVED
        fx.info("Worker %s left the job (exit status %d).", worker, status)
        fx.emit("worker_left", worker=worker, host=host, reason="stopped")
        if verdict.break_round and state.round is not None:
            rounds.mark_round_broken(state, state.round.number, f"worker {worker} was stopped", fx,
                                     repeated_error_limit=rules.config.repeated_error_limit)
    else:
        if verdict.failed_before_joining:
            state.start_failures.add(record.worker_id, record.slot.host, status, exited.last_line)
        _fail(state, record, verdict.failure, verdict.break_round, verdict.blacklist, verdict.host_failed,
              verdict.never_joined, now, rules, fx)
    if finishing and state.first_exit is None:
        state.first_exit = (now, worker)
    fx.wake(worker)  # its requests still waiting must end


def _start_afresh_if_every_member_gone(state: JobState, fx: Effects) -> None:
    """Every member of the current round has ended, one at least for want of a driver (the
    driver came back after their --driver-patience): the state they held is gone with them,
    through no fault of theirs or their hosts'. The job starts afresh on the same slots, as
    a new launch would (from the newest snapshot of --snapshot-dir, when there is one): the
    next round is a first round, numbered past the last."""
    current = state.round
    if current is None:
        return
    if any((w := state.workers.get(m)) is not None and not w.state.finished for m in current.members):
        return
    state.round_floor = max(state.round_floor, current.number)
    state.round = None
    fx.warning("Every member of round %d has left while no driver ran: starting afresh on the same slots "
               "(from the newest snapshot of --snapshot-dir, if there is one).", current.number)
    fx.emit("job_restarted_afresh", round=current.number)


def _fail(state: JobState, record: WorkerRecord, text: str, break_round: bool, blacklist: bool, host_failed: bool,
          never_joined: bool, now: float, rules: Rules, fx: Effects) -> None:
    record.state = WorkerState.FAILED
    if never_joined and not state.never_joined:
        state.never_joined = text
    record.failure = text
    state.tally.failures.append(text)
    fx.warning("%s.", text[:1].upper() + text[1:])
    host = record.slot.host
    fx.emit("worker_failed", worker=record.worker_id, host=host, reason=text)
    if break_round and state.round is not None:
        rounds.mark_round_broken(state, state.round.number, text, fx,
                                 repeated_error_limit=rules.config.repeated_error_limit)
    if not blacklist:
        return  # training is over: nothing more to run on any host
    if not state.hosts.is_blacklisted(host):
        # A slot, or the whole host when the failure says the machine is bad (see
        # HostManager.record_failure): a sibling's death never stops healthy workers.
        taken = state.hosts.record_failure(record.slot, host_failed=host_failed)
        if taken.name not in state.tally.blacklisted:
            state.tally.blacklisted.append(taken.name)
        if taken.whole_host:
            fx.emit("host_blacklisted", host=host, reason=text)
            fx.warning("Blacklisted host %s %s: %s.", host, taken.describe(), taken.why)
        else:
            fx.emit("slot_blacklisted", host=host, slot=taken.name, reason=text)
            fx.warning("Blacklisted slot %s %s: %s.", taken.name, taken.describe(), taken.why)
            return
    for other in state.live_workers():
        if other.slot.host == host:
            stop_worker(state, other, f"its host {host} is blacklisted", now, rules, fx)
