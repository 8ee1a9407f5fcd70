"""Who is in the job: the driver's membership decisions as pure functions of a snapshot.

Like ``policy`` for the job's end, nothing here changes state, starts threads or reads a
clock. Each tick the driver builds a ``MembershipView`` of what it observed and applies
what these return:

* ``plan``: the target world (oldest hosts first, at most --max-np, without the slots of
  workers leaving on a preemption notice), which live workers must leave, which slots
  need a new worker;
* ``announcement_due``: whether to bump the generation so the members of the current round
  stop at the same step (a removal at once; joiners once they wait at the rendezvous);
* ``round_to_form``: the members of the next round, once every target slot's worker waits
  at the rendezvous, fresh from the last round;
* ``awaited_arrivals``: whose arrival at the rendezvous can change one of these decisions.

Tested with table tests (tests/unit/test_membership.py), without processes or sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from lightning_elastic.launcher import policy
from lightning_elastic.launcher.hosts import HostSlots, SlotAssignment, SlotKey, assign_slots
from lightning_elastic.launcher.registry import WorkerState


class WorkerView(NamedTuple):
    # A NamedTuple, not a frozen dataclass: the driver builds one per worker for each
    # decision, and a tuple is made several times faster (thousands of workers).
    worker_id: str
    slot: SlotKey
    state: WorkerState
    leave: bool = False  # will be answered EXIT at its next rendezvous
    departing: bool = False  # asked to leave on a preemption notice: its slot is vacant
    arrived_after_round: int | None = None  # set while it waits at the rendezvous


@dataclasses.dataclass(frozen=True)
class MembershipView:
    hosts: tuple[HostSlots, ...]  # available now, oldest first
    max_np: int
    workers: tuple[WorkerView, ...]  # live workers
    target: tuple[SlotAssignment, ...] = ()  # the current target world
    round_number: int = 0  # 0: no round formed yet
    round_members: tuple[WorkerView, ...] = ()  # of the current round, finished ones included
    round_broken: bool = False
    announced_for: tuple[SlotKey, ...] | None = None  # the target last announced
    required_slots: int = 1
    # Slots whose worker left on a preemption notice a moment ago: a machine being
    # preempted goes away within its grace period, so no new worker is started there yet.
    held: frozenset[SlotKey] = frozenset()


@dataclasses.dataclass(frozen=True)
class Plan:
    target: tuple[SlotAssignment, ...]
    leave: tuple[str, ...]  # live workers whose slot is not in the target any more
    spawn: tuple[SlotAssignment, ...]  # target slots with no worker


def vacant_slots(view: MembershipView) -> frozenset[SlotKey]:
    """Slots of workers leaving on a preemption notice, or that left one a moment ago."""
    return frozenset(w.slot for w in view.workers if w.departing) | view.held


def plan(view: MembershipView) -> Plan | None:
    """The new target world, or None when the current one stands and is fully staffed."""
    desired = tuple(assign_slots(view.hosts, view.max_np, vacant_slots(view)))
    staffed = {w.slot for w in view.workers if not w.leave}
    if [a.slot for a in desired] == [a.slot for a in view.target] and all(a.slot in staffed for a in desired):
        return None
    wanted = {a.slot for a in desired}
    return Plan(
        target=desired,
        leave=tuple(w.worker_id for w in view.workers if w.slot not in wanted and not w.leave),
        spawn=tuple(a for a in desired if a.slot not in staffed),
    )


def check_plan_keeps_state(view: MembershipView, new: Plan) -> policy.Verdict | None:
    """A new world must keep a worker of the current round: it holds the state to broadcast."""
    if not view.round_number:
        return None
    member_ids = {m.worker_id for m in view.round_members}
    by_slot = {w.slot: w for w in view.workers if not w.leave}
    previous = sorted({m.slot.host for m in view.round_members})
    surviving = sorted(
        {a.slot.host for a in new.target if a.slot in by_slot and by_slot[a.slot].worker_id in member_ids}
    )
    return policy.check_previous_hosts_remain(previous, surviving, [a.slot.host for a in new.target])


def announcement_due(view: MembershipView) -> bool:
    """Should the members of the current round be told (a generation bump) to re-form now?

    Not for a broken round: its survivors' collectives fail and they come back on their
    own. A removal (or a departure) is announced at once; joiners only once every one of
    them waits at the rendezvous, so the members keep training while Python and torch start.
    """
    if not view.round_number or view.round_broken:
        return False
    target_slots = tuple(a.slot for a in view.target)
    if target_slots == view.announced_for:
        return False
    if target_slots == tuple(m.slot for m in view.round_members if not m.state.finished):
        return False
    member_ids = {m.worker_id for m in view.round_members}
    by_slot = {w.slot: w for w in view.workers}
    joiners = [by_slot.get(s) for s in target_slots if s not in by_slot or by_slot[s].worker_id not in member_ids]
    removal = any(m.leave for m in view.round_members)
    joiners_ready = all(j is not None and j.state == WorkerState.WAITING for j in joiners)
    return removal or joiners_ready


def round_to_form(view: MembershipView) -> tuple[tuple[str, SlotAssignment], ...] | None:
    """The next round's (worker id, slot assignment) pairs in rank order, or None: not yet."""
    if not view.target or len(view.target) < view.required_slots:
        return None
    by_slot = {w.slot: w for w in view.workers if not w.leave}
    members = []
    for a in view.target:
        worker = by_slot.get(a.slot)
        if worker is None or not waits_for_next_round(worker, view.round_number):
            return None
        members.append((worker.worker_id, a))
    return tuple(members)


def waits_for_next_round(worker: WorkerView, round_number: int) -> bool:
    """Is ``worker`` at the rendezvous for the round after ``round_number``? One still
    waiting from before that round formed has not left it yet."""
    return worker.state == WorkerState.WAITING and (
        not round_number or worker.arrived_after_round in (round_number, 0)
    )


def awaited_arrivals(view: MembershipView) -> tuple[set[str], set[str]]:
    """The target's workers not yet at the rendezvous, and the joiners among them: on an
    arrival there is nothing to decide until the last of either arrives (a round to form;
    joiners ready, a change to announce). See ``Registry.await_arrivals``."""
    by_slot = {w.slot: w for w in view.workers if not w.leave}
    members = {m.worker_id for m in view.round_members}
    pending = {
        worker.worker_id for a in view.target
        if (worker := by_slot.get(a.slot)) is not None and not waits_for_next_round(worker, view.round_number)
    }
    return pending, pending - members


def slots_of(assignments: Sequence[SlotAssignment]) -> tuple[SlotKey, ...]:
    return tuple(a.slot for a in assignments)
