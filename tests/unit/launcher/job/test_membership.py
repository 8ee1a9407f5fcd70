"""launcher/job/membership.py: plan, announce and form decisions, from snapshots."""

from __future__ import annotations

import dataclasses

from lightning_elastic.launcher.job.slots import HostSlots, SlotKey, assign_ranks, assign_slots
from lightning_elastic.launcher.job.membership import (
    MembershipView,
    Plan,
    WorkerView,
    announcement_due,
    awaited_arrivals,
    check_plan_keeps_state,
    plan,
    round_to_form,
    vacant_slots,
)
from lightning_elastic.launcher.job.verdict import Verdict
from lightning_elastic.launcher.job.state import WorkerState as S

A, B, C, D, E = (SlotKey(h, 0) for h in "abcde")


def hosts(*names: str) -> tuple[HostSlots, ...]:
    return tuple(HostSlots(n, 1) for n in names)


def target(*names: str) -> tuple:
    return tuple(assign_slots(hosts(*names), 8))


def w(worker_id: str, slot: SlotKey, state: S = S.MEMBER, **kw) -> WorkerView:
    return WorkerView(worker_id, slot, state, **kw)


def view(**fields) -> MembershipView:
    base = dict(hosts=hosts("a", "b"), max_np=8, workers=(), required_slots=1)
    base.update(fields)
    return MembershipView(**base)


# ----- plan ------------------------------------------------------------------------------


def test_the_first_plan_spawns_a_worker_per_slot():
    p = plan(view())
    assert p == Plan(target=target("a", "b"), leave=(), spawn=target("a", "b"))


def test_a_staffed_unchanged_target_needs_no_plan():
    v = view(workers=(w("wa", A), w("wb", B)), target=target("a", "b"))
    assert plan(v) is None


def test_a_removed_host_makes_its_worker_leave():
    v = view(hosts=hosts("a"), workers=(w("wa", A), w("wb", B)), target=target("a", "b"))
    assert plan(v) == Plan(target=target("a"), leave=("wb",), spawn=())


def test_a_worker_already_leaving_is_not_told_twice():
    v = view(hosts=hosts("a"), workers=(w("wa", A), w("wb", B, leave=True)), target=target("a", "b"))
    assert plan(v).leave == ()


def test_max_np_caps_the_target():
    v = view(hosts=hosts("a", "b", "c"), max_np=2)
    assert [a.slot for a in plan(v).target] == [A, B]


def test_a_departing_workers_slot_is_vacant_until_it_exits():
    departing = w("wb", B, leave=True, departing=True)
    v = view(workers=(w("wa", A), departing), target=target("a", "b"))
    assert vacant_slots(v) == {B}
    assert plan(v) == Plan(target=target("a"), leave=(), spawn=())  # no replacement while it leaves
    # Once it has exited, the slot is planned again: a new worker may start there.
    after = view(workers=(w("wa", A),), target=target("a"))
    assert plan(after) == Plan(target=target("a", "b"), leave=(), spawn=(target("a", "b")[1],))


def test_a_plan_that_drops_every_host_of_the_round_keeps_its_live_members_until_a_joiner_holds_the_state():
    # A rolling move (issue 34, point 10): a and b removed from the list while c's worker has
    # not joined yet. The members stay, first in rank order, until the round with c forms.
    members = (w("wa", A), w("wb", B))
    v = view(hosts=hosts("c"), workers=members, round_number=1, round_members=members, target=target("a", "b"))
    new = plan(v)
    assert [a.slot for a in new.target] == [A, B, C] and new.leave == () and [a.slot for a in new.spawn] == [C]
    assert check_plan_keeps_state(v, new) is None
    # c's worker waits: the change is announced, as a joiner is.
    after = round_view(members, (w("wc", C, S.WAITING, arrived_after_round=0),), hosts=hosts("c"),
                       target=new.target)
    assert announcement_due(after)
    # Once c is a member of the next round (it holds the state), a and b are let go.
    joined = (w("wa", A), w("wb", B), w("wc", C))
    v2 = view(hosts=hosts("c"), workers=joined, round_number=2, round_members=joined, target=new.target)
    final = plan(v2)
    assert [a.slot for a in final.target] == [C] and final.leave == ("wa", "wb")
    assert check_plan_keeps_state(v2, final) is None


def test_a_member_already_told_to_leave_is_not_the_one_kept():
    # H1 removed (its worker told to leave), then H2 too before H3's worker joined.
    members = (w("wa", A, leave=True), w("wb", B))
    v = view(hosts=hosts("c"), max_np=2, workers=members, round_number=2, round_members=members,
             target=target("b", "c"))
    new = plan(v)
    assert [a.slot for a in new.target] == [B, C] and new.leave == ()
    assert check_plan_keeps_state(v, new) is None


def test_at_most_max_np_minus_one_members_are_kept_so_a_joiner_always_fits():
    members = (w("wa", A), w("wb", B))
    v = view(hosts=hosts("c"), max_np=2, workers=members, round_number=1, round_members=members,
             target=target("a", "b"))
    new = plan(v)
    assert [a.slot for a in new.target] == [A, C] and new.leave == ("wb",)


def test_a_plan_that_drops_every_host_of_the_round_loses_the_state_once_its_members_are_gone():
    members = (w("wa", A, S.FAILED), w("wb", B, S.FAILED))
    v = view(hosts=hosts("c"), workers=(), round_number=1, round_members=members, target=target("a", "b"))
    new = plan(v)
    assert check_plan_keeps_state(v, new) == Verdict(
        False, "no host of the previous set remains (previous: a, b; now: c): the training state is lost"
    )


def test_a_plan_keeping_one_host_of_the_round_keeps_the_state():
    members = (w("wa", A), w("wb", B))
    v = view(hosts=hosts("b", "c"), workers=members, round_number=1, round_members=members, target=target("a", "b"))
    assert check_plan_keeps_state(v, plan(v)) is None


# ----- announce --------------------------------------------------------------------------


def round_view(members: tuple[WorkerView, ...], extra: tuple[WorkerView, ...] = (), **fields) -> MembershipView:
    live = tuple(m for m in members if not m.state.finished) + extra
    return view(workers=live, round_number=1, round_members=members, **fields)


def test_nothing_to_announce_when_the_target_is_the_round():
    members = (w("wa", A), w("wb", B))
    assert announcement_due(round_view(members, target=target("a", "b"))) is False


def test_a_removal_is_announced_at_once():
    members = (w("wa", A), w("wb", B, leave=True))
    assert announcement_due(round_view(members, target=target("a"))) is True


def test_a_joiner_is_announced_only_once_it_waits_at_the_rendezvous():
    members = (w("wa", A), w("wb", B))
    starting = round_view(members, (w("wc", C, S.STARTING),), hosts=hosts("a", "b", "c"), target=target("a", "b", "c"))
    assert announcement_due(starting) is False
    waiting = dataclasses.replace(starting, workers=(*members, w("wc", C, S.WAITING, arrived_after_round=0)))
    assert announcement_due(waiting) is True


def test_a_target_already_announced_is_not_announced_again():
    members = (w("wa", A), w("wb", B, leave=True))
    v = round_view(members, target=target("a"), announced_for=(A,))
    assert announcement_due(v) is False


def test_a_broken_round_is_never_announced():
    members = (w("wa", A), w("wb", B, leave=True))
    assert announcement_due(round_view(members, target=target("a"), round_broken=True)) is False


def test_nothing_is_announced_before_the_first_round():
    assert announcement_due(view(target=target("a", "b"))) is False


# ----- form ------------------------------------------------------------------------------


def test_the_first_round_forms_when_every_target_worker_waits():
    workers = (w("wa", A, S.WAITING, arrived_after_round=0), w("wb", B, S.WAITING, arrived_after_round=0))
    v = view(workers=workers, target=target("a", "b"), required_slots=2)
    assert round_to_form(v) == (("wa", target("a", "b")[0]), ("wb", target("a", "b")[1]))


def test_no_round_while_a_target_worker_is_not_waiting():
    workers = (w("wa", A, S.WAITING, arrived_after_round=0), w("wb", B, S.STARTING))
    assert round_to_form(view(workers=workers, target=target("a", "b"))) is None


def test_no_round_below_the_required_size():
    # A departure leaves a smaller target: the survivors wait for slots, not train below --min-np.
    workers = (w("wa", A, S.WAITING, arrived_after_round=1),)
    assert round_to_form(view(workers=workers, target=target("a"), round_number=1, required_slots=2)) is None


def test_a_worker_still_waiting_from_before_the_last_round_is_not_fresh():
    workers = (w("wa", A, S.WAITING, arrived_after_round=1), w("wb", B, S.WAITING, arrived_after_round=2))
    v = view(workers=workers, target=target("a", "b"), round_number=2, round_members=(w("wb", B),))
    assert round_to_form(v) == (("wb", assign_ranks([B])[0]),)


# A fault while a replacement starts: round 1 was a, b, c; c died, d replaces it.
AFTER_FAULT = dict(hosts=hosts("a", "b", "d"), target=target("a", "b", "d"), round_number=1,
                   round_members=(w("wa", A), w("wb", B), w("wc", C, S.FAILED)), round_broken=True)


def test_after_a_fault_the_survivors_form_without_waiting_for_a_replacement():
    workers = (w("wa", A, S.WAITING, arrived_after_round=1), w("wb", B, S.WAITING, arrived_after_round=1),
               w("wd", D, S.STARTING))
    formed = round_to_form(view(workers=workers, **AFTER_FAULT))
    assert formed == (("wa", assign_ranks([A, B])[0]), ("wb", assign_ranks([A, B])[1]))
    assert [a.size for _, a in formed] == [2, 2]


def test_after_a_fault_every_survivor_still_in_the_target_is_awaited():
    workers = (w("wa", A, S.WAITING, arrived_after_round=1), w("wb", B), w("wd", D, S.WAITING, arrived_after_round=0))
    assert round_to_form(view(workers=workers, **AFTER_FAULT)) is None


def test_a_replacement_already_waiting_is_taken_at_once():
    workers = (w("wa", A, S.WAITING, arrived_after_round=1), w("wb", B, S.WAITING, arrived_after_round=1),
               w("wd", D, S.WAITING, arrived_after_round=0))
    formed = round_to_form(view(workers=workers, **AFTER_FAULT))
    assert formed == tuple(zip(("wa", "wb", "wd"), target("a", "b", "d")))


def test_too_few_survivors_wait_for_replacements_but_not_for_all_of_them():
    fault = {**AFTER_FAULT, "hosts": hosts("a", "d", "e"), "target": target("a", "d", "e"), "required_slots": 2}
    survivor = w("wa", A, S.WAITING, arrived_after_round=1)
    starting = (survivor, w("wd", D, S.STARTING), w("we", E, S.STARTING))
    assert round_to_form(view(workers=starting, **fault)) is None
    one_ready = (survivor, w("wd", D, S.STARTING), w("we", E, S.WAITING, arrived_after_round=0))
    assert round_to_form(view(workers=one_ready, **fault)) == tuple(zip(("wa", "we"), assign_ranks([A, E])))


def test_no_round_of_workers_that_hold_no_state():
    # Training returned in round 1 and its members exited: a late joiner is no new round.
    fault = {**AFTER_FAULT, "round_members": (w("wa", A, S.DONE), w("wb", B, S.DONE)), "round_broken": False}
    v = view(workers=(w("wd", D, S.WAITING, arrived_after_round=0),), **fault)
    assert round_to_form(v) is None


def test_the_first_round_waits_for_its_whole_world():
    workers = (w("wa", A, S.WAITING, arrived_after_round=0), w("wb", B, S.WAITING, arrived_after_round=0),
               w("wc", C, S.STARTING))
    assert round_to_form(view(workers=workers, hosts=hosts("a", "b", "c"), target=target("a", "b", "c"))) is None


def test_a_replacement_that_arrives_after_the_round_formed_is_announced_as_a_joiner():
    members = (w("wa", A), w("wb", B))
    v = round_view(members, (w("wd", D, S.WAITING, arrived_after_round=0),), hosts=hosts("a", "b", "d"),
                   target=target("a", "b", "d"))
    assert announcement_due(v) is True


def test_a_worker_told_to_leave_is_never_a_member():
    workers = (w("wa", A, S.WAITING, arrived_after_round=0), w("wb", B, S.WAITING, leave=True, arrived_after_round=0))
    assert round_to_form(view(workers=workers, target=target("a", "b"))) is None


def test_a_slot_held_after_a_preemption_gets_no_new_worker_yet():
    v = view(workers=(w("wa", A),), target=target("a"), held=frozenset({B}))
    assert vacant_slots(v) == {B}
    assert plan(v) is None


# ----- awaited arrivals --------------------------------------------------------------------


def test_the_driver_awaits_the_world_and_its_joiners_not_those_already_back():
    members = (w("wa", A), w("wb", B))
    workers = (
        w("wa", A, S.WAITING, arrived_after_round=1),  # back from round 1: not awaited
        w("wb", B),  # still training in round 1
        w("wc", C, S.STARTING),  # a joiner
    )
    v = view(hosts=hosts("a", "b", "c"), workers=workers, target=target("a", "b", "c"),
             round_number=1, round_members=members)
    assert awaited_arrivals(v) == ({"wb"}, {"wc"})


def test_before_the_first_round_the_driver_awaits_the_whole_world():
    v = view(workers=(w("wa", A, S.STARTING), w("wb", B, S.WAITING, arrived_after_round=0)), target=target("a", "b"))
    assert awaited_arrivals(v) == ({"wa"},)


def test_members_all_back_but_too_few_every_arrival_counts():
    workers = (w("wa", A, S.WAITING, arrived_after_round=1), w("wd", D, S.STARTING), w("we", E, S.STARTING))
    v = view(workers=workers, **{**AFTER_FAULT, "target": target("a", "d", "e"), "required_slots": 2})
    assert awaited_arrivals(v) == ()


def test_leaving_workers_are_not_awaited():
    v = view(workers=(w("wa", A, S.STARTING), w("wb", B, S.MEMBER, leave=True)), target=target("a", "b"))
    assert awaited_arrivals(v) == ({"wa"},)


# ----- hot spares ----------------------------------------------------------------------------


def test_spares_take_the_slots_after_the_target_and_are_started():
    v = view(hosts=hosts("a", "b", "c", "d"), max_np=2, spares=1)
    assert plan(v) == Plan(target=target("a", "b"), leave=(), spawn=tuple(assign_slots(hosts("a", "b", "c"), 3)),
                           standby=(C,))


def test_a_staffed_standby_needs_no_plan():
    v = view(hosts=hosts("a", "b", "c"), max_np=2, spares=1, workers=(w("wa", A), w("wb", B), w("wc", C, S.WAITING)),
             target=target("a", "b"), standby=(C,))
    assert plan(v) is None


def test_a_lost_worker_is_replaced_by_the_waiting_spare_in_one_re_formation():
    members = (w("wa", A), w("wb", B, S.FAILED))
    spare = w("wc", C, S.WAITING, arrived_after_round=0)
    survivor = w("wa", A, S.WAITING, arrived_after_round=1)
    v = view(hosts=hosts("a", "c", "d"), max_np=2, spares=1, workers=(survivor, spare), target=target("a", "b"),
             standby=(C,), round_number=1, round_members=members, round_broken=True)
    new = plan(v)
    assert new is not None and new.target == target("a", "c") and new.standby == (D,)
    assert [a.slot for a in new.spawn] == [D]  # a new spare; the old one moves into the world
    formed = round_to_form(dataclasses.replace(v, target=new.target, standby=new.standby))
    assert formed == tuple(zip(("wa", "wc"), target("a", "c")))
