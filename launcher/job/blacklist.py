"""Which hosts and slots may run workers now: discovery order, age, blacklist and cooldown.

Hosts are ordered oldest first (by when they last became available) and, among hosts that
became available together, in discovery order. That order decides ranks, so surviving
workers keep the lowest ranks. The clock is passed in so the cooldown is testable without
sleeping.

A failure takes out the failed worker's slot, or its whole host (``record_failure``): on a
machine with eight GPUs, one worker's crash says little about the other seven, but a
second slot failing, or a failure of the host itself (ssh could not reach it, its node
died), says the machine is bad.

What is blacklisted, and until when, is plain data (``Blacklist``), held by ``JobState``
and saved with it; ``HostManager`` holds only what discovery tells it again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from lightning_elastic.launcher.job.field_marks import clock
from lightning_elastic.launcher.job.slots import HostSlots, SlotKey

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostChange:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    resized: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.resized)


@dataclasses.dataclass(frozen=True)
class Blacklisting:
    """A host or slot out after ``count`` failures. Frozen (a new failure replaces it): a
    save's copy of the tables may share it."""

    count: int
    until: float | None = clock(default=None)  # the cooldown's end (driver clock); None: for the rest of the job

    def active(self, now: float) -> bool:
        return self.until is None or now < self.until


@dataclasses.dataclass
class Blacklist:
    """What failures took out of the job: plain data, a part of ``JobState`` saved with it.
    ``HostManager`` decides what goes in and reads it; nothing else changes it."""

    hosts: dict[str, Blacklisting] = dataclasses.field(default_factory=dict)
    # Slots out after a failure of their own, on hosts that stay in use.
    slots: dict[SlotKey, Blacklisting] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Blacklisted:
    """What a worker's failure took out of the job, and for how long."""

    name: str  # the host, or the slot ("host[local rank]")
    whole_host: bool
    cooldown: float | None  # seconds; None: for the rest of the job
    why: str  # the rule that decided it, for the log

    def describe(self) -> str:
        return "for the rest of the job" if self.cooldown is None else f"for {self.cooldown:g} s"


# 2 ** 64 times any cooldown is beyond every MAX: the exponent stops growing there (a host
# failing every minute for weeks would otherwise overflow a float).
_MAX_DOUBLINGS = 64


class HostManager:
    def __init__(self, cooldown: tuple[float, float] | None, clock: Callable[[], float]) -> None:
        self._cooldown = cooldown
        self._clock = clock
        self._discovered: dict[str, int] = {}  # host -> slots, as last discovered
        self._age: dict[str, int] = {}  # host -> order it became available in
        self._next_age = 0
        # The job's blacklist (``JobState.blacklist``, which binds it): this manager's rules
        # decide what goes in, the table is the job's, saved with it.
        self.table = Blacklist()
        self._refreshed_at = float("-inf")  # when the available hosts were last computed
        self._available: list[HostSlots] = []

    def update(self, discovered: list[HostSlots]) -> HostChange:
        """Take a new discovery result; return how the available hosts changed."""
        self._discovered = {h.host: h.slots for h in discovered}
        return self._refresh()

    def record_failure(self, slot: SlotKey, host_failed: bool = False) -> Blacklisted:
        """A worker on ``slot`` failed: blacklist its slot, or its whole host when the
        failure was the host's own (``host_failed``: unreachable, could not start a
        process), the host has one slot, or another of its slots is still out after a
        failure of its own (two slots failing: the machine is bad, not one worker)."""
        now = self._clock()
        host = slot.host
        if host_failed:
            why = "the failure was its host's"
        elif self._discovered.get(host, 1) <= 1:
            why = "it has one slot"
        elif any(s.host == host and s != slot and e.active(now) for s, e in self.table.slots.items()):
            why = "another of its slots failed before"
        else:
            delay = self._blacklist_in(self.table.slots, slot)
            self._refresh()
            return Blacklisted(str(slot), False, delay, "its other slots stay in use")
        for other in [s for s in self.table.slots if s.host == host]:
            del self.table.slots[other]  # the host's own entry covers them now
        return Blacklisted(host, True, self.blacklist(host), why)

    def blacklist(self, host: str) -> float | None:
        """Blacklist ``host`` after a failure; returns the cooldown in seconds (None: for good)."""
        delay = self._blacklist_in(self.table.hosts, host)
        self._refresh()
        return delay

    def _blacklist_in(self, table: dict, key: object) -> float | None:
        entry = table.get(key)
        count = entry.count + 1 if entry else 1
        delay = None
        if self._cooldown is not None:
            low, high = self._cooldown
            # Exponential back-off inside the user's range: a host that keeps failing
            # stays out longer each time, but never longer than MAX.
            delay = min(high, low * 2.0 ** min(count - 1, _MAX_DOUBLINGS))
        table[key] = Blacklisting(count, None if delay is None else self._clock() + delay)
        return delay

    def use(self, blacklist: Blacklist) -> None:
        """Work on ``blacklist`` from now on (a previous driver's, restored with its job):
        its cooldowns go on as they are."""
        self.table = blacklist
        self._refresh()

    def blacklisted_slots(self) -> frozenset[SlotKey]:
        """Slots out after a failure of their own, on hosts that stay in use."""
        now = self._clock()
        return frozenset(s for s, e in self.table.slots.items() if e.active(now))

    def tick(self) -> HostChange:
        """Let hosts whose cooldown has passed come back (called every driver tick: only
        does the O(hosts) refresh when a cooldown has ended since the last one)."""
        now = self._clock()
        if any(e.until is not None and self._refreshed_at < e.until <= now for e in self.table.hosts.values()):
            return self._refresh()
        back = tuple(s.host for s, e in self.table.slots.items()
                     if e.until is not None and self._refreshed_at < e.until <= now)
        if back:
            self._refreshed_at = now
            log.info("Slot(s) back after their blacklist cooldown on %s.", ", ".join(sorted(set(back))))
            return HostChange(resized=back)  # the same hosts, with more usable slots
        return HostChange()

    def available(self) -> list[HostSlots]:
        return list(self._available)

    def is_blacklisted(self, host: str) -> bool:
        return self._is_blacklisted(host, self._clock())

    def all_blacklisted_hosts(self) -> tuple[str, ...]:
        """The discovered hosts when every one of them is blacklisted, else ()."""
        now = self._clock()
        if self._discovered and all(self._is_blacklisted(h, now) for h in self._discovered):
            return tuple(self._discovered)
        return ()

    def _is_blacklisted(self, host: str, now: float) -> bool:
        entry = self.table.hosts.get(host)
        return entry is not None and entry.active(now)

    def _refresh(self) -> HostChange:
        now = self._clock()
        self._refreshed_at = now
        before = {h.host: h.slots for h in self._available}
        usable = [h for h in self._discovered if not self._is_blacklisted(h, now)]
        usable_set = set(usable)  # no list scans: hundreds of hosts
        for host in list(self._age):
            if host not in usable_set:
                del self._age[host]  # a host that comes back later is a new, young host
        for host in usable:  # dict order = discovery order among hosts new together
            if host not in self._age:
                self._age[host] = self._next_age
                self._next_age += 1
                if host in self.table.hosts:
                    log.info("Host %s is back after its blacklist cooldown.", host)
        ordered = sorted(usable, key=self._age.__getitem__)
        self._available = [HostSlots(h, self._discovered[h]) for h in ordered]
        after = {h.host: h.slots for h in self._available}
        return HostChange(
            added=tuple(h for h in after if h not in before),
            removed=tuple(h for h in before if h not in after),
            resized=tuple(h for h in after if h in before and after[h] != before[h]),
        )
