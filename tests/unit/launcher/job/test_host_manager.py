"""launcher/job/blacklist.py: host changes, age order, blacklist and cooldown (injected clock)."""

from __future__ import annotations

import pytest

from lightning_elastic.launcher.job.blacklist import HostChange, HostManager
from lightning_elastic.launcher.job.slots import HostSlots, SlotKey


class FakeClock:
    """The clock HostManager takes by injection, moved by hand: no sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def hosts(*specs: str) -> list[HostSlots]:
    out = []
    for spec in specs:
        name, _, slots = spec.partition(":")
        out.append(HostSlots(name, int(slots or 1)))
    return out


def names(manager: HostManager) -> list[str]:
    return [h.host for h in manager.available()]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def manager(clock) -> HostManager:
    return HostManager(cooldown=None, clock=clock)


# ----- update detection ----------------------------------------------------------------


def test_first_update_adds_every_discovered_host(manager):
    change = manager.update(hosts("a:2", "b:1"))
    assert change == HostChange(added=("a", "b"))
    assert manager.available() == hosts("a:2", "b:1")


def test_same_discovery_again_is_no_change(manager):
    manager.update(hosts("a", "b"))
    change = manager.update(hosts("a", "b"))
    assert change == HostChange()
    assert not change


def test_host_change_truthiness():
    assert not HostChange()
    assert HostChange(added=("a",))
    assert HostChange(removed=("a",))
    assert HostChange(resized=("a",))


def test_update_reports_added_and_removed_hosts(manager):
    manager.update(hosts("a", "b", "c"))
    change = manager.update(hosts("a", "c", "d"))
    assert change.added == ("d",)
    assert change.removed == ("b",)
    assert change.resized == ()
    assert names(manager) == ["a", "c", "d"]


def test_update_reports_resized_hosts_and_new_slot_count(manager):
    manager.update(hosts("a:1", "b:2"))
    change = manager.update(hosts("a:4", "b:2"))
    assert change == HostChange(resized=("a",))
    assert manager.available() == hosts("a:4", "b:2")


def test_empty_discovery_removes_everything(manager):
    manager.update(hosts("a", "b"))
    change = manager.update([])
    assert change == HostChange(removed=("a", "b"))
    assert manager.available() == []


def test_available_returns_a_copy(manager):
    manager.update(hosts("a"))
    manager.available().clear()
    assert names(manager) == ["a"]


# ----- ordering ------------------------------------------------------------------------


def test_hosts_added_together_keep_discovery_order_not_name_order(manager):
    manager.update(hosts("c", "a", "b"))
    assert names(manager) == ["c", "a", "b"]


def test_older_hosts_come_first_whatever_the_discovery_order(manager):
    manager.update(hosts("b", "c"))
    manager.update(hosts("a", "c", "b"))  # a is new: after the older b and c
    assert names(manager) == ["b", "c", "a"]


def test_new_hosts_added_together_follow_their_discovery_order(manager):
    manager.update(hosts("m"))
    manager.update(hosts("z", "m", "a", "k"))
    assert names(manager) == ["m", "z", "a", "k"]


def test_host_that_leaves_and_comes_back_is_young_again(manager):
    manager.update(hosts("a", "b", "c"))
    manager.update(hosts("b", "c"))
    change = manager.update(hosts("a", "b", "c"))
    assert change == HostChange(added=("a",))
    assert names(manager) == ["b", "c", "a"]


def test_resize_keeps_the_hosts_age(manager):
    manager.update(hosts("a:1", "b:1"))
    manager.update(hosts("b:1", "a:3"))
    assert manager.available() == hosts("a:3", "b:1")


def test_order_is_deterministic_for_the_same_history(clock):
    history = [hosts("c", "a"), hosts("a", "b", "c"), hosts("d", "b", "a")]
    results = []
    for _ in range(2):
        m = HostManager(None, clock)
        for step in history:
            m.update(step)
        results.append(m.available())
    assert results[0] == results[1] == hosts("a", "b", "d")


# ----- blacklisting without a cooldown -------------------------------------------------


def test_blacklisting_removes_the_host_for_good_without_a_cooldown(manager, clock):
    manager.update(hosts("a", "b"))
    assert manager.blacklist("a") is None
    assert names(manager) == ["b"]
    assert manager.is_blacklisted("a")
    clock.now += 10**9
    assert manager.tick() == HostChange()
    manager.update(hosts("a", "b"))
    assert names(manager) == ["b"]
    assert manager.is_blacklisted("a")


def test_tick_after_blacklist_reports_nothing_new(manager):
    # blacklist() refreshes the available hosts itself.
    manager.update(hosts("a", "b"))
    manager.blacklist("b")
    assert manager.tick() == HostChange()
    assert names(manager) == ["a"]


def test_unblacklisted_host_is_not_blacklisted(manager):
    manager.update(hosts("a"))
    assert not manager.is_blacklisted("a")
    assert not manager.is_blacklisted("never-seen")


def test_a_host_can_be_blacklisted_before_it_is_discovered(manager):
    manager.blacklist("a")
    manager.update(hosts("a", "b"))
    assert names(manager) == ["b"]


# ----- cooldown ------------------------------------------------------------------------


def test_cooldown_starts_at_min_doubles_per_repeat_and_is_capped_at_max(clock):
    m = HostManager(cooldown=(10.0, 35.0), clock=clock)
    m.update(hosts("a"))
    assert [m.blacklist("a") for _ in range(5)] == [10.0, 20.0, 35.0, 35.0, 35.0]


def test_cooldown_is_counted_per_host(clock):
    m = HostManager(cooldown=(1.0, 100.0), clock=clock)
    m.update(hosts("a", "b"))
    assert m.blacklist("a") == 1.0
    assert m.blacklist("a") == 2.0
    assert m.blacklist("b") == 1.0


def test_host_comes_back_exactly_when_its_cooldown_ends(clock):
    m = HostManager(cooldown=(10.0, 60.0), clock=clock)
    m.update(hosts("a", "b"))
    m.blacklist("a")
    clock.now += 9.999
    assert m.tick() == HostChange()
    assert m.is_blacklisted("a")
    clock.now += 0.001
    assert m.tick() == HostChange(added=("a",))
    assert not m.is_blacklisted("a")
    assert names(m) == ["b", "a"]  # back as the youngest host


def test_second_blacklisting_keeps_the_host_out_twice_as_long(clock):
    m = HostManager(cooldown=(5.0, 60.0), clock=clock)
    m.update(hosts("a"))
    m.blacklist("a")
    clock.now += 5.0
    assert m.tick().added == ("a",)
    m.blacklist("a")
    clock.now += 9.0
    assert m.tick() == HostChange()
    clock.now += 1.0
    assert m.tick().added == ("a",)


def test_zero_cooldown_lets_the_host_back_at_once(clock):
    m = HostManager(cooldown=(0.0, 0.0), clock=clock)
    m.update(hosts("a"))
    assert m.blacklist("a") == 0.0
    assert not m.is_blacklisted("a")
    assert names(m) == ["a"]


def test_cooled_down_host_is_only_available_if_still_discovered(clock):
    m = HostManager(cooldown=(1.0, 1.0), clock=clock)
    m.update(hosts("a", "b"))
    m.blacklist("a")
    m.update(hosts("b"))
    clock.now += 2.0
    assert m.tick() == HostChange()
    assert names(m) == ["b"]
    assert m.update(hosts("a", "b")) == HostChange(added=("a",))


# ----- all_blacklisted_hosts -----------------------------------------------------------


def test_all_blacklisted_hosts_is_empty_while_one_host_is_usable(manager):
    manager.update(hosts("a", "b"))
    manager.blacklist("a")
    assert manager.all_blacklisted_hosts() == ()


def test_all_blacklisted_hosts_names_every_discovered_host_when_all_are_out(manager):
    manager.update(hosts("a", "b"))
    manager.blacklist("b")
    manager.blacklist("a")
    assert manager.all_blacklisted_hosts() == ("a", "b")
    assert manager.available() == []


def test_all_blacklisted_hosts_is_empty_before_any_discovery(manager):
    assert manager.all_blacklisted_hosts() == ()


def test_all_blacklisted_hosts_is_empty_when_nothing_is_discovered(manager):
    manager.update(hosts("a"))
    manager.blacklist("a")
    manager.update([])
    assert manager.all_blacklisted_hosts() == ()


def test_new_host_ends_all_blacklisted(manager):
    manager.update(hosts("a"))
    manager.blacklist("a")
    assert manager.all_blacklisted_hosts() == ("a",)
    manager.update(hosts("a", "b"))
    assert manager.all_blacklisted_hosts() == ()


def test_all_blacklisted_hosts_clears_once_a_cooldown_ends(clock):
    m = HostManager(cooldown=(3.0, 3.0), clock=clock)
    m.update(hosts("a"))
    m.blacklist("a")
    assert m.all_blacklisted_hosts() == ("a",)
    clock.now += 3.0
    assert m.all_blacklisted_hosts() == ()


# ----- failures counted per slot ---------------------------------------------------------


def test_a_failure_on_a_one_slot_host_blacklists_the_host(manager):
    manager.update(hosts("a", "b"))
    taken = manager.record_failure(SlotKey("a", 0))
    assert (taken.name, taken.whole_host, taken.cooldown) == ("a", True, None)
    assert names(manager) == ["b"] and manager.blacklisted_slots() == frozenset()


def test_one_failure_on_a_multi_slot_host_takes_out_its_slot_only(manager):
    manager.update(hosts("a:3"))
    taken = manager.record_failure(SlotKey("a", 1))
    assert (taken.name, taken.whole_host) == ("a[1]", False)
    assert names(manager) == ["a"] and not manager.is_blacklisted("a")
    assert manager.blacklisted_slots() == {SlotKey("a", 1)}


def test_a_second_slot_failing_blacklists_the_host(manager):
    manager.update(hosts("a:3", "b:1"))
    manager.record_failure(SlotKey("a", 1))
    taken = manager.record_failure(SlotKey("a", 2))
    assert (taken.name, taken.whole_host, taken.why) == ("a", True, "another of its slots failed before")
    assert names(manager) == ["b"] and manager.blacklisted_slots() == frozenset()


def test_the_same_slot_failing_again_stays_a_slot_failure(clock):
    m = HostManager(cooldown=(10.0, 100.0), clock=clock)
    m.update(hosts("a:2"))
    assert m.record_failure(SlotKey("a", 0)).cooldown == 10.0
    clock.now += 11
    assert m.tick() == HostChange(resized=("a",))  # the slot is back: a decision is due
    assert m.blacklisted_slots() == frozenset()
    again = m.record_failure(SlotKey("a", 0))
    assert (again.whole_host, again.cooldown) == (False, 20.0)


def test_a_failure_of_the_host_itself_blacklists_it_at_once(manager):
    manager.update(hosts("a:8"))
    taken = manager.record_failure(SlotKey("a", 3), host_failed=True)
    assert (taken.name, taken.whole_host) == ("a", True)


def test_a_host_failing_for_weeks_never_overflows_its_cooldown(clock):
    m = HostManager(cooldown=(60.0, 3600.0), clock=clock)
    m.update(hosts("a"))
    assert [m.blacklist("a") for _ in range(2000)][-1] == 3600.0
