"""launcher/job/exits.py as a table: what a worker's exit means (done, left, stopped, failed),
what its failure says, and what it costs (its round, its slot or host).

Each row is what the driver knew of a worker when its process ended (``ExitFacts``) and the
verdict the docs promise for it (README "What happens on a change", "Exit status" and the
faults list, docs/architecture.md "Preemption" and "How the job ends",
docs/troubleshooting.md). Rows are named after the chaos matrix's cases
(docs/reliability.md, scripts/chaos_matrix.py) they stand for; rows without a case number
are edges of the rules the matrix does not provoke.

Chaos-matrix case -> row:
  1, 16, 20, 21, 27, 36, 49, 52, 59 (a member SIGKILLed) -> "rows 1, 16, 20, 21, 27, 36, 49, 52, 59: ..."
  2 (a second worker SIGKILLed at the rendezvous)     -> "row 2: ..."
  3, 4, 31 (a second worker SIGKILLed in the new round) -> "rows 3, 4, 31: ..."
  5, 29, 30, 37, 51 (a preemption SIGTERM, left in time) -> "rows 5, 29, 30, 37, 51: ..."
  6 (preempted, not gone within --preemption-grace)   -> "row 6: ..."
  7, 32 (exit 3 after training returned)              -> "rows 7, 32: ..."
  8 (never exits after training returned: stopped)    -> "row 8: ..." (two rows, and an xfail, see below)
  9 (the same DistError ends every round)             -> "row 9: ..."
  14, 18, 34, 35 (a user exception, on one or every rank) -> "rows 14, 18, 34, 35: ..."
  15, 28 (a host removed by discovery)                -> "rows 15, 28: ..."
  17 (SIGSTOP, killed after --heartbeat-timeout)      -> "row 17: ..."
  19 (every host blacklisted: the host's last sibling stopped) -> "row 19: ..." (and the SIGKILL row)
  38 (a partitioned host's worker killed, ssh end closed) -> "row 38: ..."
  39, 40 (a machine's every process dies; its ssh connection killed) -> "rows 39, 40: ..."
  41 (a host without sshd)                            -> "row 41: ..."
  45 (a worker lost while the driver was down)        -> "row 45: ..."
  50 (a Slurm node dies: killed as wedged, or its step ends without a status) -> "row 50 ...: ..." (two rows)
  66 (a Slurm node dies, default timeouts: killed as wedged) -> "rows 50, 66 (the heartbeat timeout first): ..."
  57 (slow exits after the report, then status 0)     -> "row 57: ..."
  63 (workers that gave up on an absent driver, exit 75) -> "row 63: ..." (two rows)
  64 (a start failed on a full --state-dir)           -> "row 64: ..."
Not decided by classify_exit (the reason is in ``ELSEWHERE`` below):
  10, 33 (one rank's DistError: nobody exits; the registry's round-lost answer);
  11, 12, 13 (discovery misbehaving: the discovery thread); 22, 23, 43 (driver SIGTERM/SIGINT:
  the shell's shutdown stops every worker, the verdict says "interrupted"); 24, 42 (driver
  SIGKILL: the kernel and the supervisors); 25, 26 (a broken stdout: the output pumps);
  44, 47, 48, 55, 56 (driver restart, hand-over: restart/adoption); 46 (no driver back: the
  worker's patience); 53 (a second allocation joins: discovery and the membership plan);
  54 (--slurm outside an allocation: the CLI); 58 (the driver stopped: liveness, see
  test_liveness.py). What a case's job then does with the failures (reset limit, below
  --min-np, every host blacklisted, the job's verdict) is job/verdict.py's and the host
  manager's, not this table's.

Found against the docs by this table, and fixed in ``classify_exit``:
  - row 8: a worker stopped for --exit-timeout that traps the SIGTERM and exits 0 after its
    DONE report was classified DONE, though the docs say those stopped "count as failed";
  - a host lost (launcher detail) with exit status 0 before it joined was flagged
    ``never_joined`` (the job would have failed with the hint to call ``le.init()``): the
    docs reserve that for a script that ran and ended without joining.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_elastic.launcher.job.exits import ExitFacts, ExitKind, classify_exit, describe_status, failure_text
from lightning_elastic.protocol import EXIT_DRIVER_GONE, Outcome
from tests.unit.launcher.job.chaos_rows import coverage_gaps

DONE, LEFT, STOPPED, FAILED = ExitKind.DONE, ExitKind.LEFT, ExitKind.STOPPED, ExitKind.FAILED
W = "127.0.0.2[0]#1"
SIGKILLED, SIGTERMED = -9, -15
PREEMPTION = "SIGTERM (preemption notice)"  # what the worker's preemption handler asks to leave on
NO_HEARTBEAT = "it sent no heartbeat for 10 s (hung, stopped or unreachable)"  # liveness.wedged's words
EXIT_OVERDUE = "it did not exit within 3 s of worker 127.0.0.1[0]#0"  # liveness.exit_overdue's words


def member(status: int, **facts) -> ExitFacts:
    """A worker that joined and trains in the current round (the usual victim)."""
    return ExitFacts(**{"worker_id": W, "status": status, "joined": True, "in_round": True, **facts})


def finished(status: int, **facts) -> ExitFacts:
    """A member of a round whose training has returned (some member reported DONE)."""
    return member(status, finishing=True, **facts)


def starting(status: int, **facts) -> ExitFacts:
    """A worker that never reached the rendezvous (not joined, in no round)."""
    return ExitFacts(**{"worker_id": W, "status": status, **facts})


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    facts: ExitFacts
    kind: ExitKind
    failure: str = ""  # the whole failure text, or with ``...`` at its end: its beginning
    break_round: bool = False
    blacklist: bool = False
    host_failed: bool = False
    never_joined: bool = False
    cases: tuple[int, ...] = ()  # the chaos-matrix cases it stands for
    xfail: str = ""  # the docs' promise the code breaks
    failed_before_joining: bool = False


def failed(id: str, facts: ExitFacts, failure: str, *, cases: tuple[int, ...] = (), xfail: str = "",
           break_round: bool = False, blacklist: bool = False, host_failed: bool = False,
           never_joined: bool = False, failed_before_joining: bool = False) -> Row:
    return Row(id, facts, FAILED, failure, break_round, blacklist, host_failed, never_joined, cases, xfail,
               failed_before_joining)


ROWS = [
    # ----- success: an explicit report, then status 0 ---------------------------------
    Row("row 57 (and every success): reported done, then exited 0, however late",
        finished(0, outcome=Outcome.DONE), DONE, cases=(57,)),
    Row("reported done and exited 0 before the round knew training returned",
        member(0, outcome=Outcome.DONE), DONE),
    # ----- a member dies mid-training ------------------------------------------------------
    failed("rows 1, 16, 20, 21, 27, 36, 49, 52, 59: a member SIGKILLed mid-training",
           member(SIGKILLED), f"worker {W} was killed by SIGKILL",
           break_round=True, blacklist=True, cases=(1, 16, 20, 21, 27, 36, 49, 52, 59)),
    failed("row 2: a second worker SIGKILLed while waiting at the rendezvous of the re-formation",
           member(SIGKILLED, in_round=False), f"worker {W} was killed by SIGKILL",
           blacklist=True, cases=(2,)),
    failed("rows 3, 4, 31: a second worker SIGKILLed in the new round (reset callback, state broadcast)",
           member(SIGKILLED), f"worker {W} was killed by SIGKILL",
           break_round=True, blacklist=True, cases=(3, 4, 31)),
    failed("row 45: a worker SIGKILLed while the driver was down, found gone on adoption",
           member(SIGKILLED), f"worker {W} was killed by SIGKILL",
           break_round=True, blacklist=True, cases=(45,)),
    failed("rows 14, 18, 34, 35: a user exception: reported with its error, then exit 1",
           member(1, outcome=Outcome.FAILED, report_message="ValueError: boom"),
           f"worker {W} exited with status 1 after raising ValueError: boom",
           break_round=True, blacklist=True, cases=(14, 18, 34, 35)),
    failed("row 9: the same DistError every round: answered 'your own error', reported, exit 1",
           member(1, outcome=Outcome.FAILED, report_message="torch.distributed.DistError: step 3"),
           f"worker {W} exited with status 1 after raising torch.distributed.DistError: step 3",
           break_round=True, blacklist=True, cases=(9,)),
    failed("a reported failure without a message names only the exit",
           member(1, outcome=Outcome.FAILED), f"worker {W} exited with status 1",
           break_round=True, blacklist=True),
    failed("a member exits 0 without reporting that training returned: a failure, not a success",
           member(0), f"worker {W} exited with status 0 without reporting that training returned",
           break_round=True, blacklist=True),
    failed("a member killed by a signal with no name",
           member(-99), f"worker {W} was killed by signal 99", break_round=True, blacklist=True),
    # ----- killed by the driver as wedged ---------------------------------------------------
    failed("row 17: a SIGSTOPped member killed after --heartbeat-timeout",
           member(SIGKILLED, kill_reason=NO_HEARTBEAT), f"worker {W} was killed by SIGKILL: {NO_HEARTBEAT}",
           break_round=True, blacklist=True, cases=(17,)),
    failed("row 38: a partitioned host's worker killed as wedged (the driver closed its ssh end)",
           member(SIGKILLED, kill_reason=NO_HEARTBEAT), f"worker {W} was killed by SIGKILL: {NO_HEARTBEAT}",
           break_round=True, blacklist=True, cases=(38,)),
    failed("rows 50, 66 (the heartbeat timeout first): a crashed Slurm node's worker killed as wedged",
           member(SIGKILLED, kill_reason=NO_HEARTBEAT), f"worker {W} was killed by SIGKILL: {NO_HEARTBEAT}",
           break_round=True, blacklist=True, cases=(50, 66)),
    failed("a worker that never reached the rendezvous killed at --start-timeout",
           starting(SIGKILLED, kill_reason="it did not reach the rendezvous within 600 s"),
           f"worker {W} was killed by SIGKILL: it did not reach the rendezvous within 600 s", blacklist=True),
    # ----- the host's own failure: the whole host goes ----------------------------------
    failed("rows 39, 40: the machine dies or its ssh connection is killed: ssh ends without the worker's status",
           member(255, detail="ssh to node2 failed: Connection to node2 closed by remote host."),
           f"worker {W} was lost: ssh to node2 failed: Connection to node2 closed by remote host.",
           break_round=True, blacklist=True, host_failed=True, cases=(39, 40)),
    failed("row 50 (the step ends first): a Slurm step ended without the worker's status",
           member(255, detail="its srun step on node2 (job 7) ended without the worker's exit status "
                              "(srun status 0: no message): the node or its slurmd is gone"),
           f"worker {W} was lost: its srun step on node2 (job 7) ended without the worker's exit status ...",
           break_round=True, blacklist=True, host_failed=True, cases=(50,)),
    failed("row 41: a host without sshd: lost before it ever started, with ssh's error",
           starting(255, worker_id="node1[0]#0",
                    detail="ssh to node1 failed: ssh: connect to host node1 port 22: Connection refused"),
           "worker node1[0]#0 was lost: ssh to node1 failed: ssh: connect to host node1 port 22: Connection refused",
           blacklist=True, host_failed=True, cases=(41,)),
    failed("a host lost with status 0 before it joined is a lost host, not a script that never joins",
           starting(0, detail="the remote start on node2 failed (status 0): no message"),
           f"worker {W} was lost: the remote start on node2 failed (status 0): no message",
           blacklist=True, host_failed=True, never_joined=False),
    failed("row 64: a start that failed on this machine's disk (a full --state-dir): lost, its host's own",
           starting(127, detail="could not be started: No space left on device (/s/workers/W.log)"),
           f"worker {W} was lost: could not be started: No space left on device (/s/workers/W.log)",
           blacklist=True, host_failed=True, cases=(64,)),
    # ----- the driver was away: gave up waiting for it (--state-dir) -------------------------
    Row("row 63: an adopted member that waited --driver-patience for a driver and exited 75",
        member(EXIT_DRIVER_GONE, gave_up_on_driver=True), ExitKind.DRIVER_GONE, break_round=True, cases=(63,)),
    Row("row 63: an adopted worker that never joined a round gave up too: no round to break",
        starting(EXIT_DRIVER_GONE, gave_up_on_driver=True), ExitKind.DRIVER_GONE),
    failed("status 75 from a worker this driver started is the script's own: a failure",
           member(EXIT_DRIVER_GONE), f"worker {W} exited with status 75", break_round=True, blacklist=True),
    failed("an adopted worker killed by the driver, whatever its status, failed for the driver's reason",
           member(EXIT_DRIVER_GONE, gave_up_on_driver=True, kill_reason=NO_HEARTBEAT),
           f"worker {W} exited with status 75: {NO_HEARTBEAT}", break_round=True, blacklist=True),
    # ----- never joined ---------------------------------------------------------------------
    failed("a script that exits 0 without ever joining the job: never joined, costs its slot only",
           starting(0), f"worker {W} exited with status 0 without ever joining the job",
           blacklist=True, never_joined=True),
    failed("a script that crashes before it joins is a crash, not a script that never joins",
           starting(2), f"worker {W} exited with status 2 before joining the job", blacklist=True,
           failed_before_joining=True),
    failed("issue 37, item 7: a script that fails before it joins says its last line (an import error's)",
           starting(1, last_line="ModuleNotFoundError: No module named 'nosuch'"),
           f"worker {W} exited with status 1 before joining the job: ModuleNotFoundError: No module named 'nosuch'",
           blacklist=True, failed_before_joining=True),
    failed("a worker killed by a signal not the driver's before it joins (the OOM killer while importing)",
           starting(SIGKILLED), f"worker {W} was killed by SIGKILL before joining the job", blacklist=True,
           failed_before_joining=True),
    # ----- preemption: a graceful leave, or its fallback ------------------------------------
    Row("rows 5, 29, 30, 37, 51: a preemption SIGTERM: left at the next check, reported removed, exit 0",
        member(0, outcome=Outcome.REMOVED, leave=True, departing=PREEMPTION), LEFT, cases=(5, 29, 30, 37, 51)),
    failed("row 6: preempted, but still in its step when --preemption-grace ran out: the watchdog's 143",
           member(143, leave=True, departing=PREEMPTION),
           f"worker {W} exited with status 143 before it could leave on {PREEMPTION}",
           break_round=True, blacklist=True, cases=(6,)),
    failed("a second SIGTERM during the grace: killed by it before it could leave",
           member(SIGTERMED, leave=True, departing=PREEMPTION),
           f"worker {W} was killed by SIGTERM before it could leave on {PREEMPTION}",
           break_round=True, blacklist=True),
    failed("preempted, then killed as wedged before it left: both reasons, the notice first",
           member(SIGKILLED, leave=True, departing=PREEMPTION, kill_reason=NO_HEARTBEAT),
           f"worker {W} was killed by SIGKILL before it could leave on {PREEMPTION}: {NO_HEARTBEAT}",
           break_round=True, blacklist=True),
    # ----- removed from the job by discovery -----------------------------------------------
    Row("rows 15, 28: its host removed by discovery: answered exit at the rendezvous, reported removed, exit 0",
        member(0, outcome=Outcome.REMOVED, leave=True), LEFT, cases=(15, 28)),
    failed("reported removed, then crashed on its way out: a failure, but it had left its round",
           member(1, outcome=Outcome.REMOVED, leave=True), f"worker {W} exited with status 1 after leaving the job"),
    failed("reported removed, then killed for not exiting within --exit-timeout of the report",
           member(SIGKILLED, outcome=Outcome.REMOVED, leave=True,
                  kill_reason="it reported removed but did not exit within 60 s"),
           f"worker {W} was killed by SIGKILL after leaving the job: it reported removed but did not exit within 60 s"),
    # ----- stopped by the driver, for a reason not its own ---------------------------------
    Row("row 19: the last healthy sibling on a host blacklisted by its second failed slot, stopped",
        member(SIGTERMED, leave=True), STOPPED, break_round=True, cases=(19,)),
    Row("a stopped member that exits 0 without a report is stopped, not failed",
        member(0, leave=True), STOPPED, break_round=True),
    Row("a worker stopped before it reached the rendezvous breaks no round",
        starting(SIGTERMED, leave=True), STOPPED),
    Row("a member stopped after training returned breaks nothing",
        finished(SIGTERMED, leave=True), STOPPED),
    # ----- after training returned: failures cost the job, not a host -----------------------
    failed("rows 7, 32: a worker exits 3 after training returned",
           finished(3, outcome=Outcome.DONE), f"worker {W} exited with status 3 after training returned",
           cases=(7, 32)),
    failed("row 8: never exited after training returned: stopped at --exit-timeout, dies by the SIGTERM",
           finished(SIGTERMED, outcome=Outcome.DONE, leave=True, kill_reason=EXIT_OVERDUE),
           f"worker {W} was killed by SIGTERM after training returned: {EXIT_OVERDUE}", cases=(8,)),
    failed("row 8: never exited after training returned: SIGKILLed after --stop-grace",
           finished(SIGKILLED, outcome=Outcome.DONE, leave=True, kill_reason=EXIT_OVERDUE),
           f"worker {W} was killed by SIGKILL after training returned: {EXIT_OVERDUE}", cases=(8,)),
    failed("row 8: stopped at --exit-timeout, traps the SIGTERM and exits 0: still counted as failed",
           finished(0, outcome=Outcome.DONE, leave=True, kill_reason=EXIT_OVERDUE),
           f"worker {W} exited with status 0 ...", cases=(8,)),
    failed("a member killed (OOM) at teardown after training returned: no blacklist",
           finished(SIGKILLED, outcome=Outcome.DONE), f"worker {W} was killed by SIGKILL after training returned"),
    failed("a member that exits 0 without its report once training returned elsewhere: no blacklist",
           finished(0), f"worker {W} exited with status 0 without reporting that training returned"),
    failed("a member whose own error came as training returned elsewhere: no blacklist",
           finished(1, outcome=Outcome.FAILED, report_message="ValueError: late"),
           f"worker {W} exited with status 1 after raising ValueError: late"),
]

ELSEWHERE = {
    60: "a rolling move: the membership plan keeps the state's holders (test_membership.py, test_step.py)",
    61: "a rolling move over ssh: the membership plan keeps the state's holders (test_membership.py)",
    10: "one rank's DistError: nobody exits; the registry's round-lost answer",
    33: "one rank's DistError (Lightning): nobody exits; the registry's round-lost answer",
    11: "discovery hangs: the discovery thread",
    12: "discovery fails: the discovery thread",
    13: "discovery prints garbage: the discovery thread",
    22: "driver SIGTERM: the shell's shutdown (stop_all) and the 'interrupted' verdict",
    23: "driver SIGINT: the shell's shutdown (stop_all) and the 'interrupted' verdict",
    43: "driver SIGTERM, remote workers: the shell's shutdown and the supervisors",
    24: "driver SIGKILL: the kernel takes the local workers",
    42: "driver SIGKILL, remote workers: the supervisors",
    25: "a broken stdout: the output pumps",
    26: "a broken stdout and stderr: the output pumps",
    44: "driver restart: restart/adoption",
    47: "driver hand-over and restart on ssh hosts: restart/adoption",
    48: "driver restart mid-fit: restart/adoption",
    55: "SIGTERM hand-over: the shell and restart/",
    56: "driver restarted on another machine: restart/ and the workers' driver locator",
    46: "no driver comes back: the worker's --driver-patience",
    53: "a second Slurm allocation joins: discovery and the membership plan",
    54: "--slurm outside an allocation: the CLI",
    58: "the driver stopped: liveness (test_liveness.py)",
    62: "two snapshot writers of one job: the workers' snapshot writer (lightning_elastic/durable/)",
    65: "a driver failing while it takes the job over: the shell's shutdown (driver/lifecycle.py)",
}


def params(rows: list[Row]) -> list:
    return [pytest.param(r, id=r.id, marks=[pytest.mark.xfail(strict=True, reason=r.xfail)] if r.xfail else [])
            for r in rows]


def matches(text: str, expected: str) -> bool:
    return text.startswith(expected[:-3]) if expected.endswith("...") else text == expected


@pytest.mark.parametrize("row", params(ROWS))
def test_classify_exit(row: Row) -> None:
    verdict = classify_exit(row.facts)
    got = (verdict.kind, verdict.break_round, verdict.blacklist, verdict.host_failed, verdict.never_joined,
           verdict.failed_before_joining)
    assert got == (row.kind, row.break_round, row.blacklist, row.host_failed, row.never_joined,
                   row.failed_before_joining), verdict
    if row.kind is FAILED:
        assert matches(verdict.failure, row.failure), verdict.failure
        assert verdict.failure == failure_text(row.facts)  # the log, the summary and the verdict say the same
    else:
        assert verdict.failure == "", verdict.failure


@pytest.mark.parametrize(("status", "said"), [
    (0, "exited with status 0"),
    (3, "exited with status 3"),
    (143, "exited with status 143"),  # the preemption watchdog's exit, not a signal
    (-9, "was killed by SIGKILL"),
    (-15, "was killed by SIGTERM"),
    (-19, "was killed by SIGSTOP"),
    (-99, "was killed by signal 99"),
])
def test_describe_status(status: int, said: str) -> None:
    assert describe_status(status) == said


def test_every_matrix_case_has_a_row_or_a_reason_it_has_none() -> None:
    covered = {case for row in ROWS for case in row.cases}
    assert coverage_gaps(covered, ELSEWHERE) == {}


def test_row_ids_are_unique() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))
