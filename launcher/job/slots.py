"""Host specifications and the assignment of ranks to slots (pure functions)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from lightning_elastic.launcher.errors import ConfigError, DiscoveryError


@dataclasses.dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int


@dataclasses.dataclass(frozen=True)
class SlotKey:
    """One process slot: a worker's host and local rank, fixed for the worker's life."""

    host: str
    local_rank: int

    def __str__(self) -> str:
        return f"{self.host}[{self.local_rank}]"


@dataclasses.dataclass(frozen=True)
class SlotAssignment:
    slot: SlotKey
    rank: int
    size: int
    local_size: int
    cross_rank: int
    cross_size: int


def parse_host_entry(entry: str, default_slots: int | None, what: str) -> HostSlots:
    """Parse ``host`` or ``host:slots``; ``what`` names where the text came from."""
    text = entry.strip()
    host, sep, slots_text = text.rpartition(":")
    if not sep:
        host, slots_text = text, ""
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{what}: invalid host entry {entry!r}, expected HOST[:SLOTS]")
    if slots_text == "":
        if default_slots is None:
            raise ConfigError(
                f"{what}: host entry {entry!r} has no slot count; "
                "write HOST:SLOTS or pass --slots-per-host"
            )
        return HostSlots(host, default_slots)
    try:
        slots = int(slots_text)
    except ValueError:
        raise ConfigError(
            f"{what}: invalid slot count {slots_text!r} in {entry!r}, expected a positive integer"
        ) from None
    if slots < 1:
        raise ConfigError(f"{what}: slot count in {entry!r} must be at least 1, got {slots}")
    return HostSlots(host, slots)


# What users separate hosts with elsewhere (a shell list, a copied mpirun line): -H takes commas.
_OTHER_SEPARATORS = re.compile(r"[;|\s]+")


def parse_host_list(text: str, default_slots: int | None = None) -> list[HostSlots]:
    """Parse ``-H host1:2,host2:1``."""
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise ConfigError(f"-H/--hosts: empty host list {text!r}, expected HOST:SLOTS[,HOST:SLOTS...]")
    for entry in entries:
        found = _OTHER_SEPARATORS.search(entry.strip())
        if found:  # "a:1;b:1" would be one host named "a:1;b"
            separator = found.group()[0]
            commas = ",".join(e for e in _OTHER_SEPARATORS.split(text.strip()) if e)
            raise ConfigError(f"-H/--hosts: {text!r} separates hosts with {separator!r}: expected commas, "
                              f"HOST:SLOTS[,HOST:SLOTS...] (-H {commas})")
    return _unique([parse_host_entry(e, default_slots, "-H/--hosts") for e in entries], "-H/--hosts")


def parse_hostfile(text: str, default_slots: int | None, what: str) -> list[HostSlots]:
    """Parse a host file: one host a line, as mpirun, horovodrun and DeepSpeed write it
    (``HOST slots=N``) or as ``-H`` takes it (``HOST:SLOTS``); ``#`` starts a comment."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{what} line {number}"
        name, *fields = line.split()
        slots: str | None = None
        for field in fields:
            key, sep, value = field.partition("=")
            # mpirun's max_slots bounds oversubscription, which never happens here: ignored.
            if not sep or key not in ("slots", "max_slots", "max-slots") or ":" in name:
                raise ConfigError(f"{where}: invalid entry {raw.strip()!r}, expected HOST slots=N or HOST:SLOTS")
            if key == "slots":
                slots = value
        hosts.append(parse_host_entry(name if slots is None else f"{name}:{slots}", default_slots, where))
    if not hosts:
        raise ConfigError(f"{what}: lists no host, expected one HOST slots=N (or HOST:SLOTS) a line")
    return _unique(hosts, what)


def parse_discovery_output(text: str, default_slots: int | None) -> list[HostSlots]:
    """Parse a discovery script's output: one ``host[:slots]`` per line, blank lines ignored."""
    hosts = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            hosts.append(parse_host_entry(line, default_slots, "host discovery script output"))
        except ConfigError as err:
            raise DiscoveryError(str(err)) from None
    try:
        return _unique(hosts, "host discovery script output")
    except ConfigError as err:
        raise DiscoveryError(str(err)) from None


def _unique(hosts: list[HostSlots], what: str) -> list[HostSlots]:
    seen: set[str] = set()
    for h in hosts:
        if h.host in seen:
            raise ConfigError(f"{what}: host {h.host!r} is listed twice")
        seen.add(h.host)
    return hosts


def assign_slots(
    hosts: Sequence[HostSlots], max_np: int, vacant: AbstractSet[SlotKey] = frozenset()
) -> list[SlotAssignment]:
    """Assign ranks host by host in the given order, at most ``max_np`` in all.

    The caller orders hosts oldest first, so surviving workers keep the lowest ranks and
    rank 0 (the root of every state broadcast) holds current state. ``vacant`` slots
    (their workers are leaving) are skipped; the others keep their local rank, which a
    worker keeps for life (it names its GPU).
    """
    chosen: list[SlotKey] = []
    remaining = max_np
    for h in hosts:
        if remaining <= 0:
            break
        local_ranks = [lr for lr in range(h.slots) if SlotKey(h.host, lr) not in vacant][:remaining]
        chosen += [SlotKey(h.host, lr) for lr in local_ranks]
        remaining -= len(local_ranks)
    return assign_ranks(chosen)


def assign_ranks(slots: Sequence[SlotKey]) -> list[SlotAssignment]:
    """Ranks for ``slots`` in the given order, each host's slots together.

    Used for the planned world and for a round formed with part of it (the workers ready
    after a fault, while the others still start): ranks are always 0..len-1, the sizes
    those of the slots given. ``cross_rank`` is the host's index among the hosts that have
    a slot with the same local rank.
    """
    by_host: dict[str, list[int]] = {}
    for s in slots:
        by_host.setdefault(s.host, []).append(s.local_rank)
    # Hosts having each local rank, in order: one pass, not one per slot (O(N), at any N).
    cross_size: dict[int, int] = {}
    cross_rank: dict[tuple[str, int], int] = {}
    for host, taken in by_host.items():
        for local_rank in taken:
            cross_rank[host, local_rank] = cross_size.get(local_rank, 0)
            cross_size[local_rank] = cross_rank[host, local_rank] + 1
    size = len(slots)
    result = []
    rank = 0
    for host, taken in by_host.items():
        for local_rank in taken:
            result.append(
                SlotAssignment(
                    slot=SlotKey(host, local_rank),
                    rank=rank,
                    size=size,
                    local_size=len(taken),
                    cross_rank=cross_rank[host, local_rank],
                    cross_size=cross_size[local_rank],
                )
            )
            rank += 1
    return result


def count_slots(hosts: Iterable[HostSlots]) -> int:
    return sum(h.slots for h in hosts)
