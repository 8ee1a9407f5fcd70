"""launcher/job/liveness.py as a table: when a worker's silence turns into a kill (``wedged``),
when the workers still running after training returned are stopped (``exit_overdue``), and
how the driver's own absences are kept out of anyone's silence (``Absences``).

Each row is (worker clock, now, the driver's absences, timeouts, reset pending since, round
broken) -> the kill's reason (exact where docs/troubleshooting.md quotes it, else its
essential words) or None, the expected values taken from the docs (README options table and
"Lost machines and partitions", docs/architecture.md "How the job ends" and "Bounds",
docs/troubleshooting.md, docs/reliability.md H4). Every bound is strict: a row at exactly
the bound is still alive. Times are plain numbers of seconds; nothing here sleeps.

Chaos-matrix case -> row:
  8 (never exits after training returned)            -> "row 8: ..." (exit_overdue table)
  17 (SIGSTOP to a worker)                            -> "rows 17, 38, 50, 66: ..."
  38 (a partitioned host), 50, 66 (a crashed Slurm node) -> "rows 17, 38, 50, 66: ..."
  15, 28, 53 (a host change announced to a healthy round) -> "rows 15, 28, 53 (H4): ..." (two rows)
  44, 45, 47, 48, 55, 56 (a driver started again adopts its workers) -> "rows 44, 45, 47, 48, 55, 56: ..."
  57 (slow exits after the report, past --heartbeat-timeout) -> "row 57: ..."
  58 (the driver SIGSTOPped longer than --heartbeat-timeout) -> "row 58: ..." (three rows, and the Absences table)
Rows of the liveness rules the matrix does not provoke: a worker that never reaches the
rendezvous within --start-timeout, a member of a broken round not back within
--start-timeout of the reset, the edges at exactly each bound, and the driver's absence
against --start-timeout (two strict xfails, below).
Not decided by these rules (``ELSEWHERE`` below, one reason each): every case that ends in
an exit (1-7, 9, 14, 16, 18-21, 27, 29-37, 39-41, 49, 51, 52, 59: exit classification, see
test_exits.py), 10, 33 (the round-lost answer), 11-13 (discovery), 22-26, 42, 43 (the driver
stopped or killed, its output broken: the shell, the kernel, the supervisors), 46 (the
worker's patience), 54 (the CLI).

Found against the docs by this table, and fixed in ``wedged``: --start-timeout, for a worker
on its way to the rendezvous and for a broken round's member on its way back, counted the
time the driver did not run (``now - started_at``, ``now - reset_pending_since``), while
docs/troubleshooting.md says of a driver that did not run "no worker is taken for wedged
because of it".
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_elastic.launcher.config import Timeouts
from lightning_elastic.launcher.job.liveness import Absences, WorkerClock, exit_overdue, wedged
from tests.unit.launcher.job.chaos_rows import coverage_gaps

INTERVAL = 2.5  # the heartbeat interval: a loop turn later than this is the driver's absence
DEFAULT = Timeouts()  # --heartbeat-timeout 10, --start-timeout 600, --exit-timeout 60
FIRST = "127.0.0.1[0]#0"

NO_HEARTBEAT_10 = "it sent no heartbeat for 10 s (hung, stopped or unreachable)"
NO_HEARTBEAT_3 = "it sent no heartbeat for 3 s (hung, stopped or unreachable)"
NOT_ARRIVED = "did not reach the rendezvous within 600 s"
NOT_BACK = "did not come back to the rendezvous within 600 s of the reset"


def running(since: float = 0.0, interval: float = INTERVAL) -> Absences:
    """A driver that has run (turned every tick) from ``since`` on."""
    return Absences.starting(since, interval)


def away(left: float, back: float, started: float = 0.0, interval: float = INTERVAL) -> Absences:
    """A driver that ran from ``started``, last turned at ``left`` and turned again at ``back``."""
    absences = Absences(interval, last_turn=left, back_at=started)
    absences.turn(back)
    return absences


def training(last_heartbeat: float, **clock) -> WorkerClock:
    """A member of the current round, training, last heard from at ``last_heartbeat``."""
    return WorkerClock(**{"started_at": 0.0, "last_heartbeat": last_heartbeat, "member": True, **clock})


def arriving(started_at: float = 0.0) -> WorkerClock:
    """A worker started and not yet at the rendezvous."""
    return WorkerClock(started_at)


def reported(outcome: str, at: float, last_heartbeat: float | None = None) -> WorkerClock:
    """A member that reported how training ended at ``at`` (it stops heartbeating then)."""
    return training(at if last_heartbeat is None else last_heartbeat, reported_at=at, reported=outcome)


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    clock: WorkerClock
    now: float
    absences: Absences
    reason: str | None  # None: alive; else the reason's exact text or its essential words
    timeouts: Timeouts = DEFAULT
    reset_pending_since: float | None = None
    round_broken: bool = False
    cases: tuple[int, ...] = ()
    xfail: str = ""


ROWS = [
    # ----- the heartbeat: a worker silent while it trains -----------------------------------
    Row("a member heartbeating is alive", training(105.0), 110.0, running(), None),
    Row("rows 17, 38, 50, 66: silent past --heartbeat-timeout (SIGSTOPped, partitioned, node gone): killed",
        training(100.0), 110.5, running(), NO_HEARTBEAT_10, cases=(17, 38, 50, 66)),
    Row("silent exactly --heartbeat-timeout: not yet (the bound is strict)",
        training(100.0), 110.0, running(), None),
    Row("a worker waiting at the rendezvous (not a member) is held to the heartbeat too",
        WorkerClock(0.0, last_heartbeat=100.0), 110.5, running(), NO_HEARTBEAT_10),
    # ----- row 58: the driver's own absence is nobody's silence ------------------------------
    Row("row 58: the driver SIGSTOPped 4.5 s with --heartbeat-timeout 3: nobody killed when it continues",
        training(100.0), 104.55, away(100.05, 104.55), None, Timeouts(heartbeat_timeout=3), cases=(58,)),
    Row("row 58: after the driver is back, a worker silent for the whole timeout is killed",
        training(100.0), 107.6, away(100.05, 104.55), NO_HEARTBEAT_3, Timeouts(heartbeat_timeout=3), cases=(58,)),
    Row("row 58: silent exactly the timeout since the driver came back: not yet",
        training(100.0), 107.5, away(100.0, 104.5), None, Timeouts(heartbeat_timeout=3), cases=(58,)),
    Row("a heartbeat after the driver came back counts from itself",
        training(106.0), 116.5, away(100.0, 104.5), NO_HEARTBEAT_10),
    Row("a loop turn exactly one interval late is no absence: the silence still counts",
        training(100.0), 110.5, away(108.0, 110.5), NO_HEARTBEAT_10),
    # ----- rows 44-56: a driver started again ------------------------------------------------
    Row("rows 44, 45, 47, 48, 55, 56: an adopted worker's heartbeat deadline starts at the new driver's start",
        training(500.0, started_at=500.0), 510.0, running(since=500.0), None, cases=(44, 45, 47, 48, 55, 56)),
    Row("a heartbeat from before the driver started counts from the driver's start",
        training(100.0), 509.0, running(since=500.0), None),
    Row("... and once the driver has run the whole timeout, the silence is the worker's",
        training(100.0), 510.5, running(since=500.0), NO_HEARTBEAT_10),
    # ----- after its report: --exit-timeout, not the heartbeat ---------------------------------
    Row("row 57: reported done, no heartbeat for 4 s past --heartbeat-timeout 2: not killed",
        reported("done", at=100.0, last_heartbeat=99.5), 104.0, running(), None,
        Timeouts(heartbeat_timeout=2), cases=(57,)),
    Row("reported done and not exited within --exit-timeout: killed",
        reported("done", at=100.0), 160.5, running(), "it reported done but did not exit within 60 s"),
    Row("reported done, exactly --exit-timeout ago: not yet",
        reported("done", at=100.0), 160.0, running(), None),
    Row("reported removed (left its round) and not exited within --exit-timeout: killed",
        reported("removed", at=100.0), 160.5, running(), "it reported removed but did not exit within 60 s"),
    Row("reported failed and not exited within --exit-timeout: killed",
        reported("failed", at=100.0), 160.5, running(), "it reported failed but did not exit within 60 s"),
    Row("reported done, then the driver was away: its exit bound starts again",
        reported("done", at=100.0), 200.0, away(105.0, 150.0), None),
    Row("reported, in a round that broke meanwhile: only --exit-timeout bounds it",
        reported("done", at=100.0), 700.5, running(), "it reported done but did not exit within 60 s",
        reset_pending_since=100.0, round_broken=True),
    # ----- --start-timeout: from its start to the rendezvous ---------------------------------
    Row("a worker still importing within --start-timeout is alive", arriving(), 599.0, running(), None),
    Row("never at the rendezvous within --start-timeout: killed", arriving(), 600.5, running(), NOT_ARRIVED),
    Row("at the rendezvous exactly --start-timeout after its start: not yet", arriving(), 600.0, running(), None),
    Row("--start-timeout counts from the worker's own start", arriving(started_at=100.0), 700.0, running(), None),
    Row("the driver stopped longer than --start-timeout while a worker imported: not killed on its return",
        arriving(), 20.05, away(1.0, 20.0), None, Timeouts(worker_arrival=8)),
    # ----- a broken round: members held to --start-timeout from the reset ----------------------
    Row("a broken round's member, heartbeating but not back within --start-timeout of the reset: killed",
        training(700.0), 700.5, running(), NOT_BACK, reset_pending_since=100.0, round_broken=True),
    Row("a broken round's member, exactly --start-timeout after the reset: not yet",
        training(700.0), 700.0, running(), None, reset_pending_since=100.0, round_broken=True),
    Row("a broken round: a worker already back at the rendezvous (no longer a member) is not held to it",
        training(700.0, member=False), 700.5, running(), None, reset_pending_since=100.0, round_broken=True),
    Row("a broken round's member also silent: the reset's reason, the first it meets",
        training(100.0), 700.5, running(), NOT_BACK, reset_pending_since=100.0, round_broken=True),
    Row("a broken round while the driver was away longer than --start-timeout: its members not killed on its return",
        training(100.5), 120.05, away(101.0, 120.0), None, Timeouts(worker_arrival=8),
        reset_pending_since=100.0, round_broken=True),
    # ----- a host change announced to a healthy round ------------------------------------------
    Row("rows 15, 28, 53 (H4): a host change announced, a member heartbeating but late back: never killed",
        training(1699.0), 1700.0, running(), None, Timeouts(worker_arrival=8),
        reset_pending_since=100.0, round_broken=False, cases=(15, 28, 53)),
    Row("rows 15, 28, 53 (H4): a host change announced, a member that stops heartbeating: killed",
        training(1600.0), 1700.0, running(), NO_HEARTBEAT_10, Timeouts(worker_arrival=8),
        reset_pending_since=100.0, round_broken=False, cases=(15, 28, 53)),
    Row("a round broken with no reset pending yet: the heartbeat alone bounds a member",
        training(1699.0), 1700.0, running(), None, round_broken=True),
]


@dataclasses.dataclass(frozen=True)
class OverdueRow:
    id: str
    first_exit: tuple[float, str] | None
    now: float
    absences: Absences
    reason: str | None
    timeouts: Timeouts = DEFAULT
    cases: tuple[int, ...] = ()


EXIT_3 = Timeouts(exit=3)
OVERDUE_ROWS = [
    OverdueRow("training goes on (or returned with no exit yet): nobody is overdue", None, 1e6, running(), None),
    OverdueRow("row 8: --exit-timeout 3 s after the first exit, a worker still running is stopped",
               (100.0, FIRST), 103.5, running(), f"it did not exit within 3 s of worker {FIRST}", EXIT_3, cases=(8,)),
    OverdueRow("row 8: exactly --exit-timeout after the first exit: not yet",
               (100.0, FIRST), 103.0, running(), None, EXIT_3, cases=(8,)),
    OverdueRow("within the default --exit-timeout (60 s) after the first exit: not yet",
               (100.0, FIRST), 159.0, running(), None),
    OverdueRow("the driver away after the first exit: the --exit-timeout starts again on its return",
               (100.0, FIRST), 106.0, away(100.5, 104.0), None, EXIT_3),
    OverdueRow("... and runs out --exit-timeout after the driver's return",
               (100.0, FIRST), 107.5, away(100.5, 104.0), f"it did not exit within 3 s of worker {FIRST}", EXIT_3),
]


@dataclasses.dataclass(frozen=True)
class TurnRow:
    id: str
    absences: Absences
    turn_at: float
    away: float  # what turn() returns: the absence, or 0.0
    back_at: float  # where everyone's silence starts after it


TURN_ROWS = [
    TurnRow("a turn within the interval is no absence", running(100.0), 101.0, 0.0, 100.0),
    TurnRow("a turn exactly one interval later is no absence (strict)", running(100.0), 102.5, 0.0, 100.0),
    TurnRow("row 58: a turn 4.5 s later is an absence: said, and every silence starts again",
            running(100.0), 104.5, 4.5, 104.5),
    TurnRow("an absence of the driver before its first turn counts too",
            Absences.starting(0.0, INTERVAL), 30.0, 30.0, 30.0),
]


def params(rows: list) -> list:
    return [pytest.param(r, id=r.id, marks=[pytest.mark.xfail(strict=True, reason=r.xfail)]
                         if getattr(r, "xfail", "") else []) for r in rows]


def said(reason: str | None, expected: str | None) -> bool:
    if expected is None or reason is None:
        return reason is expected
    return reason == expected if expected.startswith("it ") else expected in reason


@pytest.mark.parametrize("row", params(ROWS))
def test_wedged(row: Row) -> None:
    reason = wedged(row.clock, row.now, row.absences, row.timeouts, row.reset_pending_since, row.round_broken)
    assert said(reason, row.reason), reason


@pytest.mark.parametrize("row", params(OVERDUE_ROWS))
def test_exit_overdue(row: OverdueRow) -> None:
    reason = exit_overdue(row.first_exit, row.now, row.absences, row.timeouts)
    assert said(reason, row.reason), reason


@pytest.mark.parametrize("row", params(TURN_ROWS))
def test_absences_turn(row: TurnRow) -> None:
    assert row.absences.turn(row.turn_at) == row.away
    assert (row.absences.last_turn, row.absences.back_at) == (row.turn_at, row.back_at)


def test_a_driver_starting_counts_nothing_before_its_start() -> None:
    absences = Absences.starting(500.0, INTERVAL)
    assert (absences.last_turn, absences.back_at) == (500.0, 500.0)
    assert absences.silent_for(100.0, 505.0) == 5.0  # heard from before the start: counted from the start
    assert absences.silent_for(503.0, 505.0) == 2.0  # heard from since: counted from the heartbeat


ELSEWHERE = {
    60: "a rolling move: the membership plan keeps the state's holders (test_membership.py, test_step.py)",
    61: "a rolling move over ssh: the membership plan keeps the state's holders (test_membership.py)",
    **{case: "it ends in an exit: exit classification (test_exits.py)"
       for case in (1, 2, 3, 4, 5, 6, 7, 9, 14, 16, 18, 19, 20, 21, 27, 29, 30, 31, 32, 34, 35, 36, 37,
                    39, 40, 41, 49, 51, 52, 59)},
    10: "one rank's DistError: the registry's round-lost answer",
    33: "one rank's DistError (Lightning): the registry's round-lost answer",
    11: "discovery hangs: the discovery thread",
    12: "discovery fails: the discovery thread",
    13: "discovery prints garbage: the discovery thread",
    22: "driver SIGTERM: the shell's shutdown",
    23: "driver SIGINT: the shell's shutdown",
    24: "driver SIGKILL: the kernel",
    25: "a broken stdout: the output pumps",
    26: "a broken stdout and stderr: the output pumps",
    42: "driver SIGKILL, remote workers: the supervisors",
    43: "driver SIGTERM, remote workers: the shell's shutdown and the supervisors",
    46: "no driver comes back: the worker's --driver-patience",
    54: "--slurm outside an allocation: the CLI",
    62: "two snapshot writers of one job: the workers' snapshot writer (lightning_elastic/durable/)",
    63: "workers that gave up on an absent driver: exit classification (test_exits.py) and the step",
    64: "a full state dir: a start that fails is an exit (test_exits.py); the keeper's own exit",
    65: "a driver failing while it takes the job over: the shell's shutdown (driver/lifecycle.py)",
}


def test_every_matrix_case_has_a_row_or_a_reason_it_has_none() -> None:
    covered = {case for rows in (ROWS, OVERDUE_ROWS) for row in rows for case in row.cases}
    assert coverage_gaps(covered, ELSEWHERE) == {}


def test_row_ids_are_unique() -> None:
    ids = [row.id for rows in (ROWS, OVERDUE_ROWS, TURN_ROWS) for row in rows]
    assert len(ids) == len(set(ids))
