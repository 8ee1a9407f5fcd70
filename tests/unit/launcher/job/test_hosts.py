"""launcher/job/slots.py: host entry parsing and rank assignment; launcher/hosts/network.py: local hosts."""

from __future__ import annotations

import socket

import pytest

from lightning_elastic.launcher.errors import ConfigError, DiscoveryError
from lightning_elastic.launcher.job.slots import (
    HostSlots,
    SlotKey,
    assign_ranks,
    assign_slots,
    count_slots,
    parse_discovery_output,
    parse_host_entry,
    parse_host_list,
)
from lightning_elastic.launcher.hosts.network import HostClassifier

# ----- parse_host_entry ----------------------------------------------------------------


def test_entry_with_slots():
    assert parse_host_entry("node1:4", None, "test") == HostSlots("node1", 4)


def test_entry_surrounding_whitespace_is_stripped():
    assert parse_host_entry("  node1:2 \t", None, "test") == HostSlots("node1", 2)


def test_entry_without_slots_uses_default():
    assert parse_host_entry("node1", 3, "test") == HostSlots("node1", 3)


def test_entry_with_empty_slot_text_uses_default():
    assert parse_host_entry("node1:", 2, "test") == HostSlots("node1", 2)


def test_entry_without_slots_and_no_default_is_refused_naming_the_entry():
    with pytest.raises(ConfigError, match=r"where: host entry 'node1' has no slot count.*--slots-per-host"):
        parse_host_entry("node1", None, "where")


@pytest.mark.parametrize("slots", ["0", "-1", "-7"])
def test_entry_with_zero_or_negative_slots_is_refused(slots):
    with pytest.raises(ConfigError, match=rf"slot count in 'h:{slots}' must be at least 1, got {int(slots)}"):
        parse_host_entry(f"h:{slots}", None, "test")


@pytest.mark.parametrize("slots", ["x", "1.5", "two", "0x2"])
def test_entry_with_non_integer_slots_is_refused(slots):
    with pytest.raises(ConfigError, match=rf"invalid slot count '{slots}' in 'h:{slots}'"):
        parse_host_entry(f"h:{slots}", None, "test")


@pytest.mark.parametrize("entry", ["", "   ", ":2", "my host:2", "a\tb"])
def test_entry_with_missing_or_blank_containing_host_is_refused(entry):
    with pytest.raises(ConfigError, match=r"invalid host entry .*expected HOST\[:SLOTS\]"):
        parse_host_entry(entry, 1, "test")


def test_entry_error_names_the_source():
    with pytest.raises(ConfigError, match=r"^my source: "):
        parse_host_entry("h:0", None, "my source")


# ----- parse_host_list -----------------------------------------------------------------


def test_host_list_keeps_the_given_order():
    assert parse_host_list("b:2,a:1,c:3") == [HostSlots("b", 2), HostSlots("a", 1), HostSlots("c", 3)]


def test_host_list_tolerates_whitespace_and_empty_entries():
    assert parse_host_list(" a:1 , ,b:2, ") == [HostSlots("a", 1), HostSlots("b", 2)]


def test_host_list_applies_default_slots_only_where_missing():
    assert parse_host_list("a,b:5", default_slots=2) == [HostSlots("a", 2), HostSlots("b", 5)]


@pytest.mark.parametrize("text", ["", "   ", ",", " , ,"])
def test_empty_host_list_is_refused(text):
    with pytest.raises(ConfigError, match=r"-H/--hosts: empty host list"):
        parse_host_list(text)


def test_duplicate_host_in_list_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"-H/--hosts: host 'a' is listed twice"):
        parse_host_list("a:1,b:1,a:2")


def test_host_list_entry_error_names_the_option():
    with pytest.raises(ConfigError, match=r"^-H/--hosts: .*'b:0'"):
        parse_host_list("a:1,b:0")


def test_host_list_without_slots_and_no_default_is_refused():
    with pytest.raises(ConfigError, match="has no slot count"):
        parse_host_list("a:1,b")


# ----- parse_discovery_output ----------------------------------------------------------


def test_discovery_output_skips_blank_lines_and_comments():
    text = "\n# the pool\n  a:2\n\n   \n  # indented comment\nb:1\n"
    assert parse_discovery_output(text, None) == [HostSlots("a", 2), HostSlots("b", 1)]


def test_discovery_output_uses_default_slots():
    assert parse_discovery_output("a\nb:3\n", 2) == [HostSlots("a", 2), HostSlots("b", 3)]


def test_empty_discovery_output_means_no_hosts():
    assert parse_discovery_output("", None) == []
    assert parse_discovery_output("\n# nothing here\n", 4) == []


def test_discovery_output_handles_crlf_line_endings():
    assert parse_discovery_output("a:1\r\nb:2\r\n", None) == [HostSlots("a", 1), HostSlots("b", 2)]


def test_discovery_output_bad_line_raises_discovery_error():
    with pytest.raises(DiscoveryError, match=r"host discovery script output: invalid slot count 'x'"):
        parse_discovery_output("a:1\nb:x\n", None)


def test_discovery_output_line_without_slots_and_no_default_raises_discovery_error():
    with pytest.raises(DiscoveryError, match="has no slot count"):
        parse_discovery_output("a\n", None)


def test_discovery_output_duplicate_raises_discovery_error():
    with pytest.raises(DiscoveryError, match=r"host 'a' is listed twice"):
        parse_discovery_output("a:1\na:2\n", None)


# ----- assign_slots / count_slots ------------------------------------------------------


def _table(assignments):
    return [
        (str(a.slot), a.rank, a.size, a.local_size, a.cross_rank, a.cross_size) for a in assignments
    ]


def test_assign_slots_ranks_hosts_in_given_order_with_local_and_cross_ranks():
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    assert _table(assign_slots(hosts, max_np=10)) == [
        # slot    rank size local_size cross_rank cross_size
        ("a[0]", 0, 6, 2, 0, 3),
        ("a[1]", 1, 6, 2, 0, 2),
        ("b[0]", 2, 6, 3, 1, 3),
        ("b[1]", 3, 6, 3, 1, 2),
        ("b[2]", 4, 6, 3, 0, 1),
        ("c[0]", 5, 6, 1, 2, 3),
    ]


def test_assign_ranks_renumbers_part_of_a_world_in_its_order():
    # A round formed with the ready part of a planned world: a[1] and b[0] still start.
    slots = [SlotKey("a", 0), SlotKey("a", 2), SlotKey("b", 1), SlotKey("c", 0)]
    assert _table(assign_ranks(slots)) == [
        ("a[0]", 0, 4, 2, 0, 2),
        ("a[2]", 1, 4, 2, 0, 1),
        ("b[1]", 2, 4, 1, 0, 1),
        ("c[0]", 3, 4, 1, 1, 2),
    ]


def test_assign_slots_order_of_hosts_decides_rank_zero():
    first = assign_slots([HostSlots("a", 1), HostSlots("b", 1)], 2)
    swapped = assign_slots([HostSlots("b", 1), HostSlots("a", 1)], 2)
    assert first[0].slot == SlotKey("a", 0)
    assert swapped[0].slot == SlotKey("b", 0)


def test_assign_slots_stops_at_max_np_and_trims_the_last_host():
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    assert _table(assign_slots(hosts, max_np=3)) == [
        ("a[0]", 0, 3, 2, 0, 2),
        ("a[1]", 1, 3, 2, 0, 1),
        ("b[0]", 2, 3, 1, 1, 2),
    ]


def test_assign_slots_with_fewer_slots_than_max_np_uses_them_all():
    result = assign_slots([HostSlots("a", 1), HostSlots("b", 1)], max_np=8)
    assert [a.rank for a in result] == [0, 1]
    assert {a.size for a in result} == {2}


@pytest.mark.parametrize("max_np", [0, -1])
def test_assign_slots_with_no_room_assigns_nothing(max_np):
    assert assign_slots([HostSlots("a", 2)], max_np) == []


def test_assign_slots_of_no_hosts_is_empty():
    assert assign_slots([], 4) == []


def test_assign_slots_is_deterministic():
    hosts = [HostSlots("z", 2), HostSlots("m", 1), HostSlots("a", 3)]
    assert assign_slots(hosts, 5) == assign_slots(list(hosts), 5)


def test_assigned_ranks_are_contiguous_and_slots_unique():
    hosts = [HostSlots(f"h{i}", i % 3 + 1) for i in range(7)]
    result = assign_slots(hosts, 11)
    assert [a.rank for a in result] == list(range(11))
    assert len({a.slot for a in result}) == 11


def test_slot_key_str():
    assert str(SlotKey("127.0.0.2", 3)) == "127.0.0.2[3]"


def test_count_slots():
    assert count_slots([HostSlots("a", 2), HostSlots("b", 5)]) == 7
    assert count_slots([]) == 0
    assert count_slots(iter([HostSlots("a", 1)])) == 1


# ----- HostClassifier.is_local ---------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.2", "127.1.2.3", "::1"])
def test_loopback_names_are_local(host):
    assert HostClassifier().is_local(host)


def test_this_machines_hostname_is_local():
    assert HostClassifier().is_local(socket.gethostname())


def test_this_machines_fqdn_is_local():
    assert HostClassifier().is_local(socket.getfqdn())


@pytest.mark.parametrize("host", ["8.8.8.8", "10.0.0.1", "some-other-machine.invalid", "localhost.invalid", ""])
def test_foreign_names_are_not_local(host):
    assert not HostClassifier().is_local(host)


def test_vacant_slots_are_skipped_and_the_others_keep_their_local_rank():
    result = assign_slots([HostSlots("a", 2), HostSlots("b", 2)], max_np=8, vacant={SlotKey("a", 0)})
    assert [(str(r.slot), r.rank, r.size, r.local_size, r.cross_rank, r.cross_size) for r in result] == [
        ("a[1]", 0, 3, 1, 0, 2),
        ("b[0]", 1, 3, 2, 0, 1),
        ("b[1]", 2, 3, 2, 1, 2),
    ]


def test_a_host_whose_slots_are_all_vacant_is_left_out():
    result = assign_slots([HostSlots("a", 1), HostSlots("b", 1)], max_np=1, vacant={SlotKey("a", 0)})
    assert [(str(r.slot), r.rank, r.size) for r in result] == [("b[0]", 0, 1)]
