"""How the job ends: pure decisions over a snapshot of what the driver observed.

Nothing here changes state, starts threads or reads a clock: the driver builds a
``JobView`` every tick and applies the ``Verdict``. Tested by building views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lightning_elastic.launcher.job.exits import start_failure
from lightning_elastic.launcher.job.state import WorkerState
from lightning_elastic.launcher.job.wording import listing


@dataclasses.dataclass(frozen=True)
class Verdict:
    success: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class MemberView:
    worker_id: str
    state: WorkerState
    failure: str  # why it failed, when it did
    reported_done: bool = False  # said that training returned (it may not have exited yet)


@dataclasses.dataclass(frozen=True)
class JobView:
    round_number: int  # 0: no round formed yet
    members: tuple[MemberView, ...]  # of the current round, in rank order
    live_workers: int
    blacklisted_hosts: tuple[str, ...]  # when every discovered host is blacklisted, else ()
    required_slots: int  # -np before the first round, --min-np after
    available_slots: int
    below_required_for: float | None  # seconds spent below required_slots, if below now
    discovery_error: str | None  # the latest discovery failure, if the latest poll failed
    last_failure: str = ""  # the latest worker failure, to explain a blacklist
    blacklisted: tuple[str, ...] = ()  # hosts and slots blacklisted so far, for the verdict
    repeated_error: str | None = None  # the same collective error ended too many rounds
    # Can the available slots still grow? Not from a fixed host list with no blacklist
    # cooldown and no slot held after a preemption: waiting for slots there is hopeless.
    slots_can_grow: bool = True
    # That worker's failure, when a worker exited 0 without ever reaching the rendezvous and
    # no worker of the job ever has: the command does not join the job (a script without
    # le.init()). Once another worker has joined, the script joins on some hosts and not on
    # others: the failure is that host's (or slot's), not the job's.
    never_joined: str = ""
    # Workers that failed before joining, while no worker of the job ever joined (None
    # otherwise): when the job cannot start any more, the script failed, not the hosts.
    start_failures: StartFailuresView | None = None


@dataclasses.dataclass(frozen=True)
class StartFailuresView:
    """The script failed before joining on these workers, and no worker ever joined."""

    count: int  # workers that failed before joining
    hosts: tuple[str, ...]  # their hosts, sorted
    worker_id: str  # the first of them ...
    status: int  # ... its exit status ...
    last_line: str  # ... and its last output line ("": it printed nothing)
    still_starting: int  # live workers that have not joined yet (they may fail the same way)


# The fix for a command that exits without joining the job.
JOIN_HINT = (
    "the script must join it: call lightning_elastic.init() (before @le.run), or build "
    'Trainer(strategy="elastic_hvd") or Fabric(strategy="elastic_hvd")'
)


def decide_verdict(view: JobView, elastic_timeout: float, start_failure_grace: float = 5.0) -> Verdict | None:
    """The job's end, or None while it goes on. Checked in order of how informative it is.

    ``start_failure_grace`` (``Timeouts.start_failure_grace``): once the job cannot start
    and every worker that ended failed before joining, how long the verdict waits for the
    workers still starting, to say whether the script failed on every host.
    """
    members = view.members
    if view.repeated_error:
        return Verdict(False, view.repeated_error)
    if members and any(m.reported_done for m in members):
        # Training returned: the job succeeds only if every member also exits 0. Wait for
        # all of them (--exit-timeout bounds it) so none is cut off while saving results.
        if not all(m.state.finished for m in members):
            return None
        unfinished = [m for m in members if m.state != WorkerState.DONE]
        if not unfinished:
            return Verdict(True, f"training finished on all {len(members)} worker(s) of round {view.round_number}")
        first = unfinished[0]
        return Verdict(
            False,
            f"training returned in round {view.round_number} but not every worker finished cleanly: "
            f"{first.failure or f'worker {first.worker_id} was {first.state.value}'}",
        )
    if view.never_joined:
        return Verdict(False, f"{view.never_joined}; {JOIN_HINT}")
    failed = [m for m in members if m.state == WorkerState.FAILED]
    if members and len(failed) == len(members):
        return Verdict(
            False,
            f"all {len(members)} worker(s) of round {view.round_number} failed; "
            f"first: {failed[0].failure}",
        )
    out_of_slots = _out_of_slots(view, elastic_timeout)
    if out_of_slots is None or view.start_failures is None:
        return out_of_slots
    # No worker ever joined, and those that ended failed before joining: the hosts are not
    # the cause (no advice about --min-np or hosts), the script is; its error says why.
    failures = view.start_failures
    if failures.still_starting and (view.below_required_for or 0.0) < start_failure_grace:
        return None  # the others run the same script: wait (bounded) for how they end
    return Verdict(False, script_failed(failures))


def script_failed(failures: StartFailuresView) -> str:
    """The verdict when the script failed before joining: where, and its error's last line."""
    first = start_failure(failures.worker_id, failures.status, failures.last_line)
    hosts = listing(failures.hosts)
    if failures.still_starting:
        return (f"the script failed before joining the job ({failures.count} worker(s) on {hosts}; none joined, "
                f"{failures.still_starting} still starting): {first}")
    return f"the script failed on every host before joining the job ({failures.count} worker(s) on {hosts}): {first}"


def _out_of_slots(view: JobView, elastic_timeout: float) -> Verdict | None:
    """The job's end for want of hosts or slots, or None."""
    if view.live_workers == 0 and view.blacklisted_hosts:
        detail = f"; last failure: {view.last_failure}" if view.last_failure else ""
        return Verdict(False, f"every host is blacklisted ({', '.join(view.blacklisted_hosts)}){detail}")
    if view.below_required_for is not None and not view.slots_can_grow:
        lost = f" ({', '.join(view.blacklisted)} blacklisted for the rest of the job)" if view.blacklisted else ""
        return Verdict(
            False,
            f"{view.required_slots} slot(s) needed and {view.available_slots} left in the fixed host list{lost}, "
            "which can never grow: lower --min-np, or give hosts with --host-discovery-script",
        )
    if view.below_required_for is not None and view.below_required_for >= elastic_timeout:
        detail = f"; last discovery error: {view.discovery_error}" if view.discovery_error else ""
        return Verdict(
            False,
            f"timed out after {elastic_timeout:g} s waiting for {view.required_slots} slot(s) "
            f"({view.available_slots} available){detail}",
        )
    return None


def check_reset_limit(resets_done: int, reset_limit: int | None) -> Verdict | None:
    """Before forming another round after ``resets_done`` resets."""
    if reset_limit is not None and resets_done + 1 > reset_limit:
        return Verdict(False, f"reset limit {reset_limit} exceeded")
    return None


def check_previous_hosts_remain(
    previous_hosts: Sequence[str], surviving_hosts: Sequence[str], target_hosts: Sequence[str]
) -> Verdict | None:
    """A new round must keep a worker of the previous round: it holds the state to broadcast."""
    if previous_hosts and not surviving_hosts:
        return Verdict(
            False,
            f"no host of the previous set remains (previous: {', '.join(previous_hosts)}; "
            f"now: {', '.join(target_hosts) or 'none'}): the training state is lost",
        )
    return None
