"""Which hosts are this machine, which address the driver serves on, which interface reaches it.

Standard library and psutil only: the ssh supervisor uses ``collective_interface_env`` on
remote hosts, where loading torch for it would cost seconds per start. IPv4 only.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Mapping

import psutil

from lightning_elastic.launcher.errors import ConfigError

# Variables that pick the interface gloo and NCCL bind to; a value the user set is kept.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def local_addresses() -> dict[str, str]:
    """Every IPv4 address of this machine (network namespace), mapped to its interface."""
    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET:
                found[a.address] = name
    return found


def resolve(host: str) -> str | None:
    """The IPv4 address ``host`` names, or None when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError, UnicodeError):
        return None


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to reach ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))  # UDP connect only picks a route
            return s.getsockname()[0]
        except OSError:
            return None


class HostClassifier:
    """Tells this machine's own names and addresses from other machines, once per name.

    Local: ``localhost``, the host names, any loopback address (``127.0.0.2`` makes a distinct
    host on one machine), and any name that resolves to an address of a local interface.
    Results are cached: discovery repeats the same names every second and a resolver can
    be slow. The discovery thread asks first (``DiscoveryPoller``'s ``prepare``), so the
    driver's loop finds each answer cached. Dict operations are atomic: two threads asking
    at once at worst both resolve.
    """

    def __init__(self) -> None:
        self._names = {"localhost", socket.gethostname(), socket.getfqdn()}
        self._addresses = set(local_addresses())
        self._cache: dict[str, bool] = {}
        self._unresolved: set[str] = set()

    MAX_NAMES = 65_536  # a job of weeks in an autoscaling group sees names come and go

    def is_local(self, host: str) -> bool:
        local = self._cache.get(host)
        if local is None:
            if len(self._cache) >= self.MAX_NAMES:  # start over: only costs lookups again
                self._cache.clear()
                self._unresolved.clear()
            local = self._cache[host] = self._classify(host)
        return local

    def resolves(self, host: str) -> bool:
        """Does ``host`` name an address here (this machine's names always do)? Cached with
        ``is_local``: a name that did not resolve is not asked of the resolver again."""
        self.is_local(host)
        return host not in self._unresolved

    def _classify(self, host: str) -> bool:
        if host in self._names:
            return True
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            address = resolve(host)
            if address is None:
                self._unresolved.add(host)
                return False
            literal = ipaddress.ip_address(address)
        return literal.is_loopback or str(literal) in self._addresses


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return None


def interface_address(interface: str) -> str:
    for address, name in local_addresses().items():
        if name == interface:
            return address
    names = ", ".join(sorted(set(local_addresses().values()))) or "none"
    raise ConfigError(f"--network-interface: {interface!r} has no IPv4 address here (interfaces: {names})")


def choose_driver_address(
    hosts: Iterable[str],
    is_local: Callable[[str], bool],
    address: str | None = None,
    interface: str | None = None,
) -> str:
    """The one address the driver serves on: explicit, an interface's, or the route to the hosts.

    A job of local hosts only is served on loopback and exposes nothing to the network.
    Otherwise the address is the one the kernel uses to reach the remote hosts, which must
    agree: services bound to every interface would be reachable from networks the job
    does not use. A name that does not resolve gives no route: the driver refuses that host
    (see ``Driver``); only when no host resolves is there no address to choose.
    """
    explicit = explicit_driver_address(address, interface)
    if explicit is not None:
        return explicit
    remote = [h for h in hosts if not is_local(h)]
    if not remote:
        return "127.0.0.1"
    sources: dict[str, str] = {}
    unresolved = []
    for host in remote:
        target = resolve(host)
        if target is None:
            unresolved.append(host)
            continue
        source = route_source(target)
        if source is not None:
            sources[host] = source
    if not sources:
        if len(unresolved) == len(remote):
            raise ConfigError(unresolved_names_message(unresolved))
        raise ConfigError(
            f"no route to any of the hosts {', '.join(h for h in remote if h not in unresolved)}: "
            "pass --driver-address or --network-interface"
        )
    distinct = sorted(set(sources.values()))
    if len(distinct) > 1:
        via = ", ".join(f"{h} via {a}" for h, a in sorted(sources.items()))
        raise ConfigError(
            f"the hosts are reached through different local addresses ({via}): "
            "pass --driver-address or --network-interface"
        )
    return distinct[0]


def explicit_driver_address(address: str | None, interface: str | None) -> str | None:
    """The address --driver-address or --network-interface names, checked; None when neither
    is given. Raises ConfigError for an address or interface this machine does not have."""
    if address is not None:
        if _literal(address) is None:
            raise ConfigError(f"--driver-address: expected an IPv4 address, got {address!r}")
        if address not in local_addresses():
            raise ConfigError(f"--driver-address: {address} is not an address of this machine")
        return address
    if interface is not None:
        return interface_address(interface)
    return None


def unresolved_names_message(hosts: Iterable[str]) -> str:
    """Why no host can be used when none of their names resolves (a typo, DNS, /etc/hosts)."""
    return (
        f"no host name resolves ({', '.join(hosts)}): check the names, DNS or /etc/hosts "
        "(for an ssh config alias pass --driver-address or --network-interface)"
    )


def collective_interface_env(environ: Mapping[str, str], toward: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the interface that reaches ``toward``.

    Without them gloo binds to whatever the host name resolves to, which on many machines
    is 127.0.1.1 or a management network. Only variables the user has not set are returned.
    """
    missing = [v for v in INTERFACE_VARIABLES if v not in environ]
    if not missing:
        return {}
    source = route_source(toward)
    interface = local_addresses().get(source) if source else None
    if interface is None:
        return {}
    return {v: interface for v in missing}
