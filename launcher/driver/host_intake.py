"""Hosts from discovery into the job: the newest result taken, and hosts the driver cannot use
(a name that does not resolve, another machine while it serves on loopback) refused, said once."""

from __future__ import annotations

import logging

from lightning_elastic.launcher.job.step import HostsListed

log = logging.getLogger("lightning_elastic.driver")


# Hosts the driver said it ignores ("say it once"), at most this many remembered.
REFUSED_HOSTS_KEPT = 4096


class HostIntake:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _take_discovery(self) -> HostsListed | None:
        """Discovery's newest result for the core, with the hosts the driver cannot use left
        out (said once each); None when there is nothing new.

        With ``--agents`` the hosts connected agents offer come after discovery's, taken in
        the same turn as they change: a lost agent's host is gone from the list in the turn
        its workers are reaped, so no new worker is planned on it.
        """
        latest = self._discovery.latest()
        agents = self._agents
        if agents is not None:
            agents.expire()
        agents_version = agents.version if agents is not None else 0
        if ((latest is None or latest.sequence == self._discovery_seq)
                and agents_version == self._agents_version):
            return None
        self._agents_version = agents_version
        if latest is not None and latest.sequence != self._discovery_seq:
            self._discovery_seq = latest.sequence
            if latest.hosts is None:
                return HostsListed(None, latest.error)
            self._discovered = list(latest.hosts)  # kept for the turns in which only agents change
        offered = agents.hosts() if agents is not None else []
        if agents is not None:
            agents.list_hosts(frozenset(h.host for h in self._discovered))
        # One host, one source (its workers would start twice). The board refuses an agent
        # for a listed host; an agent connected before discovery listed its host keeps it
        # (its workers run there), and the listing is ignored while it stays connected.
        served = {h.host for h in offered}
        for host in self._discovered:
            if host.host in served:
                self._refuse(host.host, "an agent connected for it before the host source listed it; the agent "
                                        "keeps it (list the host in one place)")
        listed = [*(h for h in self._discovered if h.host not in served), *offered]
        return HostsListed(tuple(h for h in listed if self._reachable(h.host)),
                           latest.error if latest is not None else None)

    def _reachable(self, host: str) -> bool:
        """A remote host cannot reach services bound to loopback: refuse it, say how to fix it."""
        if not self._name_usable(host):
            return False
        if self._is_local(host) or not self._address.startswith("127."):
            return True
        self._refuse(host, "it is another machine, and the driver serves on loopback (the first hosts were "
                           "all local); pass --driver-address or --network-interface")
        return False

    def _name_usable(self, host: str) -> bool:
        """Refuse a host whose name does not resolve, that host alone: the others go on."""
        if not self._name_unresolved(host):
            return True
        self._refuse(host, "its name does not resolve (check it, DNS or /etc/hosts; for an ssh config alias "
                           "pass --driver-address or --network-interface); the job goes on with the other hosts")
        return False

    def _look_up(self, host: str) -> None:
        """In the discovery thread: what the loop will ask of a host's name, asked first, so
        a slow resolver never holds the loop (and the service waiting on its lock)."""
        self._is_local(host)
        if self._resolves is not None:
            self._resolves(host)

    def _name_unresolved(self, host: str) -> bool:
        """Does the driver need ``host``'s name to resolve, and it does not?

        Only when the driver picks its address from the routes to the hosts. With
        --driver-address or --network-interface it never needs the name, and ssh may know it
        (an alias in ~/.ssh/config) where DNS does not; an ssh failure then refuses the host.
        """
        c = self._config
        if self._resolves is None or c.driver_address is not None or c.network_interface is not None:
            return False
        return not (self._is_local(host) or self._resolves(host))

    def _refuse(self, host: str, why: str) -> None:
        if host not in self._refused_hosts:  # discovery lists it again every second: say it once
            if len(self._refused_hosts) >= REFUSED_HOSTS_KEPT:
                # A discovery that lists ever new bad names for weeks: start again (a host
                # refused long ago is said once more at worst).
                self._refused_hosts.clear()
            self._refused_hosts.add(host)
            log.error("Ignoring host %s: %s.", host, why)
