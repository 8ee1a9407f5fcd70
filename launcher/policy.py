"""How the job ends: pure decisions over a snapshot of what the driver observed.

Nothing here changes state, starts threads or reads a clock: the driver builds a
``JobView`` every tick and applies the ``Verdict``. Tested by building views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from launcher.registry import WorkerState


@dataclasses.dataclass(frozen=True)
class Verdict:
    success: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class MemberView:
    worker_id: str
    state: WorkerState
    failure: str  # why it failed, when it did


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


def decide_verdict(view: JobView, elastic_timeout: float) -> Verdict | None:
    """The job's end, or None while it goes on. Checked in order of how informative it is."""
    members = view.members
    states = [m.state for m in members]
    if members and all(s == WorkerState.DONE for s in states):
        return Verdict(True, f"training finished on all {len(members)} worker(s) of round {view.round_number}")
    failed = [m for m in members if m.state == WorkerState.FAILED]
    if failed and WorkerState.DONE in states:
        return Verdict(
            False,
            f"worker {failed[0].worker_id} failed after other workers of round "
            f"{view.round_number} had finished: {failed[0].failure}",
        )
    if members and len(failed) == len(members):
        return Verdict(
            False,
            f"all {len(members)} worker(s) of round {view.round_number} failed; "
            f"first: {failed[0].failure}",
        )
    if view.live_workers == 0 and view.blacklisted_hosts:
        detail = f"; last failure: {view.last_failure}" if view.last_failure else ""
        return Verdict(False, f"every host is blacklisted ({', '.join(view.blacklisted_hosts)}){detail}")
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
