"""launcher/hosts/network.py: local hosts, the driver's address, the collectives' interface."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from lightning_elastic.launcher.hosts import network
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.hosts.network import (
    HostClassifier,
    choose_driver_address,
    collective_interface_env,
    local_addresses,
)

TEST_NET = "198.51.100.7"  # TEST-NET-2: never an address of this machine


def own_non_loopback_address() -> str:
    found = [a for a in local_addresses() if not ipaddress.ip_address(a).is_loopback]
    if not found:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return found[0]


def nothing_is_local(host: str) -> bool:
    return False


def everything_is_local(host: str) -> bool:
    return True


def refuse(*args):
    raise AssertionError(f"not expected to be called, got {args}")


# ----- local_addresses -----------------------------------------------------------------


def test_local_addresses_map_loopback_to_its_interface():
    addresses = local_addresses()
    assert addresses["127.0.0.1"] == "lo"
    assert all(isinstance(ipaddress.ip_address(a), ipaddress.IPv4Address) for a in addresses)


# ----- HostClassifier.is_local ---------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost", socket.gethostname(), "127.0.0.1", "127.0.0.2"])
def test_this_machines_names_and_loopback_addresses_are_local(host):
    assert HostClassifier().is_local(host) is True


def test_own_non_loopback_address_is_local():
    assert HostClassifier().is_local(own_non_loopback_address()) is True


@pytest.mark.parametrize("host", ["no-such-host.invalid", TEST_NET])
def test_unresolvable_name_and_foreign_address_are_not_local(host):
    assert HostClassifier().is_local(host) is False


def test_name_resolving_to_an_own_interface_address_is_local(monkeypatch):
    own = own_non_loopback_address()
    monkeypatch.setattr(network, "resolve", lambda host: own if host == "node-a.example" else None)
    classifier = HostClassifier()
    assert classifier.is_local("node-a.example") is True
    assert classifier.is_local("node-b.example") is False


def test_name_resolving_to_loopback_is_local(monkeypatch):
    monkeypatch.setattr(network, "resolve", lambda host: "127.0.1.1")  # Debian's hostname entry
    assert HostClassifier().is_local("my-alias.example") is True


def test_classification_is_cached_per_name(monkeypatch):
    calls = []

    def counting_resolve(host):
        calls.append(host)
        return TEST_NET

    monkeypatch.setattr(network, "resolve", counting_resolve)
    classifier = HostClassifier()
    assert classifier.is_local("node-a.example") is False
    assert classifier.is_local("node-a.example") is False
    assert calls == ["node-a.example"]
    assert classifier.is_local("node-b.example") is False
    assert calls == ["node-a.example", "node-b.example"]


def test_address_literals_are_not_resolved(monkeypatch):
    monkeypatch.setattr(network, "resolve", refuse)
    classifier = HostClassifier()
    assert classifier.is_local("127.0.0.3") is True
    assert classifier.is_local(TEST_NET) is False


# ----- choose_driver_address: explicit address -----------------------------------------


def test_explicit_local_address_is_used_without_looking_at_the_hosts(monkeypatch):
    monkeypatch.setattr(network, "resolve", refuse)
    monkeypatch.setattr(network, "route_source", refuse)
    own = own_non_loopback_address()
    assert choose_driver_address(["node-a"], nothing_is_local, address=own) == own
    assert choose_driver_address(["node-a"], nothing_is_local, address="127.0.0.1") == "127.0.0.1"


def test_explicit_address_wins_over_interface():
    assert choose_driver_address([], everything_is_local, address="127.0.0.1", interface="no-such-if0") == "127.0.0.1"


def test_explicit_address_not_of_this_machine_is_refused():
    with pytest.raises(ConfigError) as info:
        choose_driver_address(["node-a"], nothing_is_local, address=TEST_NET)
    assert str(info.value) == f"--driver-address: {TEST_NET} is not an address of this machine"


@pytest.mark.parametrize("address", ["::1", "node-a", "127.0.0.256", ""])
def test_explicit_address_that_is_not_ipv4_is_refused(address):
    with pytest.raises(ConfigError) as info:
        choose_driver_address([], everything_is_local, address=address)
    assert str(info.value) == f"--driver-address: expected an IPv4 address, got {address!r}"


# ----- choose_driver_address: interface ------------------------------------------------


def test_loopback_interface_gives_its_address():
    assert choose_driver_address(["node-a"], nothing_is_local, interface="lo") == "127.0.0.1"


def test_interface_gives_its_own_address():
    own = own_non_loopback_address()
    assert choose_driver_address([], everything_is_local, interface=local_addresses()[own]) == own


def test_unknown_interface_is_refused_listing_the_interfaces():
    names = ", ".join(sorted(set(local_addresses().values())))
    with pytest.raises(ConfigError) as info:
        choose_driver_address(["node-a"], nothing_is_local, interface="no-such-if0")
    assert str(info.value) == (
        f"--network-interface: 'no-such-if0' has no IPv4 address here (interfaces: {names})"
    )
    assert "lo" in names.split(", ")


# ----- choose_driver_address: from the route to the hosts ------------------------------


def test_local_hosts_only_are_served_on_loopback(monkeypatch):
    monkeypatch.setattr(network, "resolve", refuse)
    monkeypatch.setattr(network, "route_source", refuse)
    assert choose_driver_address(["localhost", "127.0.0.2"], everything_is_local) == "127.0.0.1"
    assert choose_driver_address([], nothing_is_local) == "127.0.0.1"


def test_remote_hosts_sharing_a_route_source_give_that_source(monkeypatch):
    targets = {"node-a": "10.0.0.11", "node-b": "10.0.0.12"}
    monkeypatch.setattr(network, "resolve", targets.get)
    monkeypatch.setattr(network, "route_source", lambda address: "10.0.0.1")
    assert choose_driver_address(["node-a", "node-b", "localhost"], lambda h: h == "localhost") == "10.0.0.1"


def test_remote_hosts_reached_through_different_addresses_are_refused(monkeypatch):
    targets = {"node-a": "10.0.0.11", "node-b": "10.1.0.12"}
    sources = {"10.0.0.11": "10.0.0.1", "10.1.0.12": "10.1.0.1"}
    monkeypatch.setattr(network, "resolve", targets.get)
    monkeypatch.setattr(network, "route_source", sources.get)
    with pytest.raises(ConfigError) as info:
        choose_driver_address(["node-b", "node-a"], nothing_is_local)
    assert str(info.value) == (
        "the hosts are reached through different local addresses (node-a via 10.0.0.1, node-b via 10.1.0.1): "
        "pass --driver-address or --network-interface"
    )


def test_hosts_without_any_route_are_refused(monkeypatch):
    monkeypatch.setattr(network, "resolve", {"node-a": "10.0.0.11"}.get)  # node-b does not resolve
    monkeypatch.setattr(network, "route_source", lambda address: None)
    with pytest.raises(ConfigError) as info:
        choose_driver_address(["node-a", "node-b"], nothing_is_local)
    assert str(info.value) == (  # node-b is not named: the driver refuses it for its name alone
        "no route to any of the hosts node-a: pass --driver-address or --network-interface"
    )


def test_hosts_none_of_which_resolves_are_refused_saying_so(monkeypatch):
    monkeypatch.setattr(network, "resolve", lambda host: None)
    monkeypatch.setattr(network, "route_source", refuse)
    with pytest.raises(ConfigError) as info:
        choose_driver_address(["node-a", "node-b"], nothing_is_local)
    assert str(info.value) == (
        "no host name resolves (node-a, node-b): check the names, DNS or /etc/hosts (for an ssh config alias "
        "pass --driver-address or --network-interface)"
    )


def test_classifier_says_which_names_resolve_asking_the_resolver_once(monkeypatch):
    asked = []
    monkeypatch.setattr(network, "resolve", lambda host: asked.append(host) or {"node-a": "10.0.0.11"}.get(host))
    classifier = HostClassifier()
    assert classifier.resolves("node-a") and not classifier.resolves("nosuch.invalid")
    assert not classifier.resolves("nosuch.invalid")
    assert classifier.resolves("localhost") and classifier.resolves("127.0.0.2") and classifier.resolves(TEST_NET)
    assert asked == ["node-a", "nosuch.invalid"]


def test_a_real_name_that_cannot_resolve_does_not():
    assert not HostClassifier().resolves("nosuch-host.invalid")  # RFC 6761: .invalid never resolves


def test_an_unroutable_host_beside_a_routable_one_uses_the_routable_ones_source(monkeypatch):
    monkeypatch.setattr(network, "resolve", {"node-a": "10.0.0.11"}.get)
    monkeypatch.setattr(network, "route_source", {"10.0.0.11": "10.0.0.1"}.get)
    assert choose_driver_address(["node-a", "node-b"], nothing_is_local) == "10.0.0.1"


def test_real_route_to_a_remote_address_gives_a_local_address():
    source = network.route_source(TEST_NET)
    if source is None:
        pytest.skip("no route to TEST-NET on this machine")
    chosen = choose_driver_address([TEST_NET], HostClassifier().is_local)
    assert chosen == source
    assert chosen in local_addresses()


def test_route_source_toward_loopback_is_loopback():
    assert network.route_source("127.0.0.1") == "127.0.0.1"


# ----- collective_interface_env --------------------------------------------------------


def test_toward_loopback_both_variables_name_lo():
    assert collective_interface_env({}, "127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_user_set_variable_is_kept_and_only_the_missing_one_returned():
    assert collective_interface_env({"GLOO_SOCKET_IFNAME": "eth7"}, "127.0.0.1") == {"NCCL_SOCKET_IFNAME": "lo"}
    assert collective_interface_env({"NCCL_SOCKET_IFNAME": "ib0"}, "127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}


def test_both_user_set_gives_nothing_and_looks_up_no_route(monkeypatch):
    monkeypatch.setattr(network, "route_source", refuse)
    environ = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib0"}
    assert collective_interface_env(environ, "127.0.0.1") == {}


def test_interface_of_the_route_source_is_named(monkeypatch):
    own = own_non_loopback_address()
    monkeypatch.setattr(network, "route_source", lambda address: own if address == "10.9.9.9" else None)
    interface = local_addresses()[own]
    assert collective_interface_env({}, "10.9.9.9") == {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


@pytest.mark.parametrize("source", [None, "10.123.45.67"], ids=["no-route", "source-not-on-an-interface"])
def test_unknown_route_gives_nothing(monkeypatch, source):
    monkeypatch.setattr(network, "route_source", lambda address: source)
    assert collective_interface_env({}, "10.9.9.9") == {}


def test_unresolvable_target_gives_nothing():
    assert collective_interface_env({}, "no-such-host.invalid") == {}
