"""Is a worker alive and coming back: the rules that turn a hang into a kill.

A hung worker (SIGSTOPped, wedged in a kernel, cut off by a partition) would hold its peers
in a collective until the process-group timeout; killing it makes their collective fail at
once. These rules say when a worker's silence means that, as pure functions of the facts
and ``now``: nothing here signals a process or reads a clock.

A worker is wedged when, counting only time the driver itself was running (``Absences``):
- it reported how training ended and has not exited within --exit-timeout (it stops
  heartbeating to exit: the heartbeat timeout does not apply to it any more);
- it never reached the rendezvous within --start-timeout of its start;
- it is a member of a round that lost a member, and has not come back to the rendezvous
  within --start-timeout of the reset (a loop with no collective never notices);
- its last heartbeat is older than --heartbeat-timeout.

Tested as a table (tests/unit/launcher/job/test_liveness.py).
"""

from __future__ import annotations

import dataclasses

from lightning_elastic.launcher.config import Timeouts


@dataclasses.dataclass
class Absences:
    """The driver's own absences: time it did not run is no worker's silence.

    A driver stopped with Ctrl-Z (or SIGSTOP, a debugger, a suspended machine, a frozen
    container) serves no request meanwhile: every heartbeat waits unread in its socket.
    Once it runs again it would find every heartbeat older than the timeout and kill the
    whole healthy job before the service has read them. So the loop notes each turn, and a
    turn after a gap longer than ``longer_than`` (the heartbeat interval) starts every
    worker's silence again (``back_at``). Starting workers counts as turns: the driver is
    busy then, not away. A pass that itself takes longer than the interval delays a wedged
    verdict by at most one timeout, the price of never mistaking the driver's absence for
    the workers'.
    """

    longer_than: float
    last_turn: float
    back_at: float  # nothing before the driver started is anyone's silence either

    @classmethod
    def starting(cls, now: float, longer_than: float) -> Absences:
        return cls(longer_than, now, now)

    def turn(self, now: float) -> float:
        """The loop turned at ``now``; returns how long it was away when that counts as an
        absence (0.0 otherwise), for the shell to say."""
        away = now - self.last_turn
        self.last_turn = now
        if away <= self.longer_than:
            return 0.0
        self.back_at = now
        return away

    def silent_for(self, since: float, now: float) -> float:
        """How long a worker last heard from at ``since`` has been silent while the driver ran."""
        return now - max(since, self.back_at)


@dataclasses.dataclass(frozen=True)
class WorkerClock:
    """What liveness knows of one live worker."""

    started_at: float
    last_heartbeat: float | None = None  # None: never reached the rendezvous
    reported_at: float | None = None  # when its report of how training ended arrived
    reported: str = ""  # that outcome's value ("done", "failed", "removed")
    member: bool = False  # a member of the current round (state MEMBER)


def wedged(w: WorkerClock, now: float, absences: Absences, timeouts: Timeouts,
           reset_pending_since: float | None = None, round_broken: bool = False) -> str | None:
    """Why ``w`` must be killed as wedged, or None while it may still be alive and coming.

    ``reset_pending_since``: when the members of the current round were asked to come back
    (it lost a member, or a host change was announced); ``round_broken``: the current round
    lost a member. A member is bounded on its return only after a loss: after an announced
    host change a member comes back at its next check of host updates, which may be a long
    validation pass away, and while it heartbeats it is training.
    """
    t = timeouts
    if w.reported_at is not None:
        if absences.silent_for(w.reported_at, now) > t.exit:
            return f"it reported {w.reported} but did not exit within {t.exit:g} s"
        return None
    if w.last_heartbeat is None:
        if absences.silent_for(w.started_at, now) > t.worker_arrival:
            return f"it did not reach the rendezvous within {t.worker_arrival:g} s"
        return None
    if (reset_pending_since is not None and round_broken and w.member
            and absences.silent_for(reset_pending_since, now) > t.worker_arrival):
        return f"it did not come back to the rendezvous within {t.worker_arrival:g} s of the reset"
    if absences.silent_for(w.last_heartbeat, now) > t.heartbeat_timeout:
        return f"it sent no heartbeat for {t.heartbeat_timeout:g} s (hung, stopped or unreachable)"
    return None


def exit_overdue(first_exit: tuple[float, str] | None, now: float, absences: Absences,
                 timeouts: Timeouts) -> str | None:
    """Training returned and worker ``first_exit[1]`` exited at ``first_exit[0]``: the reason to
    stop every worker still running once --exit-timeout has passed, else None."""
    if first_exit is None:
        return None
    since, first = first_exit
    if absences.silent_for(since, now) <= timeouts.exit:
        return None
    return f"it did not exit within {timeouts.exit:g} s of worker {first}"
