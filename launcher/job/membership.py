"""Who is in the job: the driver's membership decisions as pure functions of a snapshot.

Like ``policy`` for the job's end, nothing here changes state, starts threads or reads a
clock. Each tick the driver builds a ``MembershipView`` of what it observed and applies
what these return:

* ``plan``: the target world (oldest hosts first, at most --max-np, without the slots of
  workers leaving on a preemption notice), the standby slots after it (--spares), which
  live workers must leave, which slots need a new worker; the members holding the state
  stay in it until it has reached a worker that stays (``state_holders_kept``);
* ``announcement_due``: whether to bump the generation so the members of the current round
  stop at the same step (a removal at once; joiners once they wait at the rendezvous);
* ``round_to_form``: the members of the next round. The first round waits for its whole
  world; later rounds for every member of the last round still in the target, and take
  whoever else is ready: a fault never waits for a replacement's start-up, which joins
  later through the host-change path (live state, no rollback);
* ``awaited_arrivals``: whose arrival at the rendezvous can change one of these decisions.

Tested with table tests (tests/unit/launcher/job/test_membership.py), without processes or sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.job.slots import HostSlots, SlotAssignment, SlotKey, assign_ranks, assign_slots
from lightning_elastic.launcher.job.state import WorkerState


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
    # Slots given no worker for now: a worker left them on a preemption notice a moment ago
    # (a machine being preempted goes away within its grace period), or their worker
    # failed and they cool down while the host's other slots stay in use.
    held: frozenset[SlotKey] = frozenset()
    spares: int = 0  # --spares: workers kept started and waiting beyond the target
    standby: tuple[SlotKey, ...] = ()  # the current standby slots (after the target's)


@dataclasses.dataclass(frozen=True)
class Plan:
    target: tuple[SlotAssignment, ...]
    leave: tuple[str, ...]  # live workers whose slot is neither in the target nor standby
    spawn: tuple[SlotAssignment, ...]  # target and standby slots with no worker
    standby: tuple[SlotKey, ...] = ()  # slots of hot spares: started, waiting, in no round


def vacant_slots(view: MembershipView) -> frozenset[SlotKey]:
    """Slots of workers leaving on a preemption notice, or held (left one a moment ago, or
    cooling down after a failure)."""
    return frozenset(w.slot for w in view.workers if w.departing) | view.held


def plan(view: MembershipView) -> Plan | None:
    """The new target world, or None when the current one stands and is fully staffed.

    With --spares K the next K slots after the target are standby: their workers start,
    import and wait at the rendezvous, in no round, until a change moves their slot into
    the target (the slots are in host order, so a spare's slot is the next one taken).
    """
    desired = assign_slots(view.hosts, view.max_np + view.spares, vacant_slots(view))
    held = state_holders_kept(view, [a.slot for a in desired[:view.max_np]])
    if held:
        desired = assign_ranks([*held, *(a.slot for a in desired)][:view.max_np + view.spares])
    # Ranks over the target alone only when standby slots were planned after it: otherwise
    # the planned world is the target, ranks and all (a pass at every decision, O(N)).
    if len(desired) <= view.max_np:
        target = tuple(desired)
    else:
        target = tuple(assign_ranks([a.slot for a in desired[:view.max_np]]))
    standby = tuple(a.slot for a in desired[view.max_np:])
    staffed = {w.slot for w in view.workers if not w.leave}
    if ([a.slot for a in target] == [a.slot for a in view.target] and standby == view.standby
            and all(a.slot in staffed for a in desired)):
        return None
    wanted = {a.slot for a in desired}
    return Plan(
        target=target,
        leave=tuple(w.worker_id for w in view.workers if w.slot not in wanted and not w.leave),
        spawn=tuple(a for a in desired if a.slot not in staffed),
        standby=standby,
    )


def state_holders_kept(view: MembershipView, target: list[SlotKey]) -> tuple[SlotKey, ...]:
    """The slots of the current round's members to keep in the target although their hosts
    left the list: none of them is in ``target`` (every holder of the state would go), and a
    worker that stays is coming (``target`` is not empty).

    A graceful removal never loses the state: the members stay (leading the ranks, so rank 0
    holds the state) until the round formed with the joiners has given it to them; the plan
    after that round lets them go. Only a fault may lose the state. (An operator moving a job
    H1 -> H1,H2 -> H2,H3 -> H3 removes H2 before H3's workers have joined.) The wait is as
    long as the joiners' start, which --start-timeout bounds. At most ``max_np - 1`` members
    are kept, so that a joiner's slot always remains.
    """
    if not view.round_number or not target:
        return ()
    live = {w.worker_id: w for w in view.workers}
    # Not one already told to leave (its EXIT is on its way) or leaving on a preemption notice.
    holders = [m.slot for m in view.round_members
               if (w := live.get(m.worker_id)) is not None and not w.state.finished and not w.leave
               and not w.departing]
    wanted = set(target)
    if not holders or any(slot in wanted for slot in holders):
        return ()
    return tuple(holders[:max(1, view.max_np - len(target))])


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
    joiners_ready = all(j is not None and waits_for_next_round(j, view.round_number) for j in joiners)
    return removal or joiners_ready


def round_to_form(view: MembershipView) -> tuple[tuple[str, SlotAssignment], ...] | None:
    """The next round's (worker id, slot assignment) pairs in rank order, or None: not yet.

    The first round waits for every target worker (the world the user asked for). A later
    round waits for every member of the last round that is still in the target (they hold
    the state, and come back within milliseconds of a fault or an announcement) and takes
    whichever other target workers already wait, at least ``required_slots`` in all: a
    worker still starting (a replacement on a spare host, which may take minutes to import
    and initialise a GPU) joins the round after, as a host added during training does.
    Ranks follow the target's order, renumbered over the workers taken.
    """
    if not view.target:
        return None
    by_slot = {w.slot: w for w in view.workers if not w.leave}
    members = {m.worker_id for m in view.round_members}
    ready: list[tuple[str, SlotAssignment]] = []
    for a in view.target:
        worker = by_slot.get(a.slot)
        if worker is not None and waits_for_next_round(worker, view.round_number):
            ready.append((worker.worker_id, a))
        elif not view.round_number or (worker is not None and worker.worker_id in members):
            return None
    if len(ready) < max(view.required_slots, 1):
        return None
    if view.round_number and not any(worker_id in members for worker_id, _ in ready):
        return None  # no holder of the state among them (e.g. training returned): not a round
    if len(ready) == len(view.target):
        return tuple(ready)
    ranks = assign_ranks([a.slot for _, a in ready])
    return tuple((worker_id, a) for (worker_id, _), a in zip(ready, ranks))


def waits_for_next_round(worker: WorkerView, round_number: int) -> bool:
    """Is ``worker`` at the rendezvous for the round after ``round_number``? One still
    waiting from before that round formed has not left it yet."""
    return worker.state == WorkerState.WAITING and (
        not round_number or worker.arrived_after_round in (round_number, 0)
    )


def awaited_arrivals(view: MembershipView) -> tuple[set[str], ...]:
    """Groups of target workers not yet at the rendezvous: on an arrival there is nothing
    to decide until the last of one group arrives. Before the first round: the whole
    target (a round to form). Later: the last round's members (a round to form) and the
    joiners (ready: a change to announce). Once the members are all back but too few to
    form a round, no groups: any arrival may complete one. See ``Registry.await_arrivals``."""
    by_slot = {w.slot: w for w in view.workers if not w.leave}
    members = {m.worker_id for m in view.round_members}
    pending = {
        worker.worker_id for a in view.target
        if (worker := by_slot.get(a.slot)) is not None and not waits_for_next_round(worker, view.round_number)
    }
    if not view.round_number:
        return (pending,)
    pending_members = pending & members
    if not pending_members:
        return ()
    return pending_members, pending - members


def slots_of(assignments: Sequence[SlotAssignment]) -> tuple[SlotKey, ...]:
    return tuple(a.slot for a in assignments)
