"""What a worker's exit means: done, a graceful leave, a stop, or a failure, and what the
failure costs (its round, its slot or host).

The rule the job's fate turns on, as one pure function of what the driver knew of the
worker when its process ended (``ExitFacts``): nothing here changes state, signals a
process or reads a clock. Success is only ever an explicit report that training returned
followed by status 0: an exit status of 0 alone proves nothing (a preempted worker, or a
script that never joined, exits 0 too).

Tested as a table (tests/unit/launcher/job/test_exits.py), one row per case of the chaos
matrix that ends in an exit.
"""

from __future__ import annotations

import dataclasses
import signal
from enum import Enum

from lightning_elastic.protocol import Outcome


class ExitKind(str, Enum):
    """How a worker's life in the job ended, as its exit is classified."""

    DONE = "done"  # reported that training returned, then exited 0
    LEFT = "left"  # left its round cleanly (its slot was removed, or a preemption notice)
    STOPPED = "stopped"  # told to leave or stopped by the driver, for a reason not its own
    # Gave up on the driver: a worker of a previous driver that waited --driver-patience for
    # one and exited (``protocol.EXIT_DRIVER_GONE``) before this driver adopted it. The
    # driver's absence, not its host's fault: its slot gets a new worker.
    DRIVER_GONE = "driver gone"
    FAILED = "failed"  # anything else: its slot (or host) pays for it


@dataclasses.dataclass(frozen=True)
class ExitFacts:
    """What the driver knew of a worker when its process ended."""

    worker_id: str
    status: int  # the exit status; negative: the signal that killed it
    detail: str = ""  # the launcher's word that the host itself failed (ssh lost it, its node died)
    outcome: Outcome | None = None  # what it reported, if it did
    report_message: str = ""  # the error it reported (outcome FAILED)
    joined: bool = False  # it reached the rendezvous at least once
    leave: bool = False  # it was told to leave (or is being stopped)
    departing: str = ""  # why it asked to leave (a preemption notice)
    kill_reason: str = ""  # why the driver killed or stopped it, if it did
    in_round: bool = False  # a member of the current round
    finishing: bool = False  # training has returned in the current round
    # Adopted from a previous driver and exited with protocol.EXIT_DRIVER_GONE: it waited for
    # a driver for its whole --driver-patience (a status of this driver's own workers is theirs).
    gave_up_on_driver: bool = False
    last_line: str = ""  # its last output line (kept for a worker that failed before it joined)
    # Lost with its host's agent (lost or gone, ``launcher/service/agent_board.py``): the host
    # left the job with its agent, so there is nothing to blacklist; an agent that comes
    # back is a host added.
    host_gone: bool = False


@dataclasses.dataclass(frozen=True)
class ExitVerdict:
    kind: ExitKind
    # For a failure: "worker ID <how>", the line the log, the summary and the verdict show.
    failure: str = ""
    break_round: bool = False  # its round lost a member: the survivors must re-form
    blacklist: bool = False  # its slot (or host) is taken out of the job
    host_failed: bool = False  # the failure was the host's own: blacklist the whole host
    never_joined: bool = False  # exited 0 without ever reaching the rendezvous
    # Failed (non-zero, or a signal not the driver's) before ever reaching the rendezvous: an
    # import error, a syntax error, a missing file. On every host, the script's own failure.
    failed_before_joining: bool = False


def describe_status(status: int) -> str:
    """``exited with status 3`` / ``was killed by SIGKILL``, for failure messages."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def classify_exit(facts: ExitFacts) -> ExitVerdict:
    """The meaning of one worker's exit (see the module docstring).

    Once training has returned in the round (``finishing``) nothing is broken or
    blacklisted any more: there is nothing left to run, and the job's verdict judges the
    members' exits.
    """
    f = facts
    if f.outcome == Outcome.DONE and f.status == 0 and not f.kill_reason:
        # (Stopped by the driver, say at --exit-timeout, it failed however it then exited.)
        return ExitVerdict(ExitKind.DONE)
    if f.outcome == Outcome.REMOVED:
        if f.status != 0:  # it left its round cleanly, then crashed on its way out: no round to break
            return ExitVerdict(ExitKind.FAILED, failure_text(f))
        return ExitVerdict(ExitKind.LEFT)
    if f.gave_up_on_driver and not f.kill_reason and f.outcome != Outcome.DONE:
        # No driver to wait for: not its failure, but its round lost it.
        return ExitVerdict(ExitKind.DRIVER_GONE, break_round=f.in_round and not f.finishing)
    if f.leave and not f.departing and not f.kill_reason:
        # Told to leave (its slot was removed) or stopped by the driver: not a failure, but
        # a member that goes before it reaches the rendezvous is lost to its round.
        return ExitVerdict(ExitKind.STOPPED, break_round=f.in_round and not f.finishing)
    return ExitVerdict(
        ExitKind.FAILED,
        failure_text(f),
        break_round=f.in_round and not f.finishing,
        blacklist=not f.finishing and not f.host_gone,
        host_failed=bool(f.detail),
        # A script that ran and ended without joining; not a lost host (``detail``).
        never_joined=f.status == 0 and not f.joined and not f.detail,
        failed_before_joining=_failed_before_joining(f),
    )


def _failed_before_joining(f: ExitFacts) -> bool:
    """Did the script itself fail before it joined (not the host, not the driver)?"""
    return f.status != 0 and not f.joined and not f.detail and not f.kill_reason and not f.leave


def start_failure(worker_id: str, status: int, last_line: str) -> str:
    """``worker ID exited with status 1: LAST LINE``: a failure before joining, as the
    job's verdict names it."""
    return f"worker {worker_id} {describe_status(status)}" + (f": {last_line}" if last_line else "")


def failure_text(f: ExitFacts) -> str:
    """``worker ID <how it ended>``: what it did, then why the driver had acted on it."""
    if f.detail:
        how = f"was lost: {f.detail}"
    elif f.status == 0 and not f.joined:
        how = "exited with status 0 without ever joining the job"
    elif f.status == 0 and f.outcome == Outcome.DONE:
        how = "exited with status 0 after training returned"
    elif f.status == 0:
        how = "exited with status 0 without reporting that training returned"
    elif _failed_before_joining(f):
        how = f"{describe_status(f.status)} before joining the job"
        if f.last_line:
            how += f": {f.last_line}"
    else:
        how = describe_status(f.status)
    if f.outcome == Outcome.DONE and f.status != 0:
        how += " after training returned"
    elif f.outcome == Outcome.REMOVED:
        how += " after leaving the job"
    if f.departing:
        how += f" before it could leave on {f.departing}"
    if f.kill_reason:
        how += f": {f.kill_reason}"
    if f.outcome == Outcome.FAILED and f.report_message:
        how += f" after raising {f.report_message}"
    return f"worker {f.worker_id} {how}"
