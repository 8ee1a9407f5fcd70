"""Where the rows of a sharded state live, and who moves which rows at a reset: pure decisions.

FSDP2 (``fully_shard`` on a 1-D mesh) shards every parameter, and AdamW's moments with it,
on dim 0 as ``torch.chunk`` does: a tensor of ``n`` rows at world size ``W`` gives each rank
``ceil(n / W)`` rows in rank order, so the last ranks may hold fewer rows or none
(``rows_of``).

Each rank commits its own rows (its *own* copy) and holds the committed rows of one other
rank (its *held* copy): rank ``r``'s copy is held by rank ``(r + shift) % W``, with the
smallest shift that puts every holder on another host than the rank it covers
(``holder_shift``). Ranks are numbered host by host, so on hosts of equal size that shift is
the host size. Then any one lost host loses no committed row; on a single host, any one
lost rank.

At a reset every member says what it holds (``Holding``); ``choose_commit`` picks the
newest commit of which every rank of its layout is still held somewhere, and lists the
row ranges each new rank receives from which member (``plan_transfers``), read from the own copy
of the rank that committed them when it survives, else from its holder's copy. Nothing
here touches torch.distributed: the same plan is computed on every member from the same
gathered holdings, so every member posts the same transfers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

NONE = -1  # no rank, no version


def rows_of(rank: int, world: int, rows: int) -> tuple[int, int]:
    """``[start, stop)``: the rows of a ``rows``-row tensor that ``rank`` holds at ``world``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a world of {world}: expected 0 <= rank < world")
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def holder_shift(hosts: Sequence[str]) -> int:
    """The shift ``s`` such that rank ``r``'s copy lives on rank ``(r + s) % W``: the smallest
    that puts every copy on another host; 1 when no shift can (one host); 0 alone."""
    world = len(hosts)
    if world < 2:
        return 0
    for shift in range(1, world):
        if all(hosts[(r + shift) % world] != hosts[r] for r in range(world)):
            return shift
    return 1


def covers_hosts(hosts: Sequence[str], shift: int) -> bool:
    """Whether one lost host loses no committed row (else: one lost rank)."""
    world = len(hosts)
    return world > 1 and shift > 0 and all(hosts[(r + shift) % world] != hosts[r] for r in range(world))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a commit's rows were laid out: the world it was committed at, and its copies."""

    round: int  # the round whose group made the commit (tells layouts of equal size apart)
    world: int
    shift: int

    def holder(self, rank: int) -> int:
        return (rank + self.shift) % self.world if self.shift else NONE

    def covered(self, rank: int) -> int:
        """The rank whose copy ``rank`` holds."""
        return (rank - self.shift) % self.world if self.shift else NONE


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one member of the new round holds (sent to every member at a reset).

    ``own_rank`` is the rank this member had in ``layout`` (NONE for a joiner, or when its
    own copy is not whole); ``held_rank`` the rank whose copy it holds, at ``held_version``.
    A copy being written is never reported: its version is NONE until its last byte is in.
    """

    layout: Layout | None
    own_rank: int = NONE
    own_version: int = NONE
    held_rank: int = NONE
    held_version: int = NONE


@dataclasses.dataclass(frozen=True)
class Source:
    """Where old rank ``rank``'s committed rows are read: member ``member``'s own or held copy."""

    member: int
    held: bool


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows ``[src_row, src_row + rows)`` of old rank ``old_rank``'s part of tensor ``entry``,
    read from member ``src`` (its own copy, or its held copy if ``held``), written at row
    ``dst_row`` of member ``dst``'s new part of that tensor."""

    entry: int
    src: int
    held: bool
    old_rank: int
    src_row: int
    dst: int
    dst_row: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Restore:
    """Restore commit ``version`` of ``layout`` into a world of ``world`` members."""

    layout: Layout
    version: int
    sources: tuple[Source, ...]  # by old rank
    replicated_from: int  # a member whose own copy is that commit: it sends the rest of the state


@dataclasses.dataclass(frozen=True)
class Fresh:
    """No member holds a commit: every member starts from the model's first weights."""


@dataclasses.dataclass(frozen=True)
class Lost:
    """No commit is whole among the members: ``reason`` says which ranks' rows are gone."""

    reason: str


def _sources(holdings: Sequence[Holding], layout: Layout, version: int) -> list[Source] | None:
    found: dict[int, Source] = {}
    for member, h in enumerate(holdings):
        if h.layout != layout:
            continue
        if h.own_version == version and h.own_rank != NONE:
            found[h.own_rank] = Source(member, held=False)  # an own copy is preferred
    for member, h in enumerate(holdings):
        if h.layout != layout:
            continue
        if h.held_version == version and h.held_rank != NONE and h.held_rank not in found:
            found[h.held_rank] = Source(member, held=True)
    if len(found) < layout.world:
        return None
    return [found[r] for r in range(layout.world)]


def _missing(holdings: Sequence[Holding], layout: Layout, version: int) -> list[int]:
    have = {h.own_rank for h in holdings if h.layout == layout and h.own_version == version}
    have |= {h.held_rank for h in holdings if h.layout == layout and h.held_version == version}
    return [r for r in range(layout.world) if r not in have]


def choose_commit(holdings: Sequence[Holding]) -> Restore | Fresh | Lost:
    """What the members (``holdings`` in new-rank order) restore, and from whom.

    The newest version wins of which every rank of its layout is held by some member; a
    member's own copy is read before a holder's copy of the same rows.
    """
    candidates = sorted({(h.own_version, h.layout) for h in holdings if h.layout is not None and h.own_version != NONE}
                        | {(h.held_version, h.layout) for h in holdings
                           if h.layout is not None and h.held_version != NONE},
                        key=lambda c: (c[0], c[1].round), reverse=True)
    if not candidates:
        return Fresh()
    for version, layout in candidates:
        sources = _sources(holdings, layout, version)
        if sources is None:
            continue
        replicated_from = next((m for m, h in enumerate(holdings)
                                if h.layout == layout and h.own_version == version and h.own_rank != NONE), NONE)
        if replicated_from == NONE:
            continue  # rows alone, and nobody with the rest of that commit
        return Restore(layout, version, tuple(sources), replicated_from)
    version, layout = candidates[0]
    missing = _missing(holdings, layout, version)
    ranks = ", ".join(map(str, missing)) or "none"
    return Lost(f"commit {version} (world size {layout.world}) lost rank(s) {ranks} together with the copy of "
                f"their shards (each copy lives on rank + {layout.shift})")


def plan_transfers(sources: Sequence[Source], old_world: int, new_world: int,
                   row_counts: Sequence[int]) -> list[Transfer]:
    """The row ranges each of ``new_world`` members receives, tensor by tensor (``row_counts``:
    every sharded tensor's dim-0 size, in entry order), from the member ``sources`` names
    for the old rank that committed them. The same list, in the same order, on every member."""
    out: list[Transfer] = []
    for entry, rows in enumerate(row_counts):
        for new_rank in range(new_world):
            lo, hi = rows_of(new_rank, new_world, rows)
            for old_rank in range(old_world):
                a, b = rows_of(old_rank, old_world, rows)
                start, stop = max(lo, a), min(hi, b)
                if start >= stop:
                    continue
                s = sources[old_rank]
                out.append(Transfer(entry=entry, src=s.member, held=s.held, old_rank=old_rank, src_row=start - a,
                                    dst=new_rank, dst_row=start - lo, rows=stop - start))
    return out


def describe_coverage(hosts: Sequence[str], shift: int) -> str:
    """One sentence for the log: what a lost rank or host costs with copies at rank + ``shift``."""
    if shift == 0:
        return "Sharded state: one rank, no copy of its commit held elsewhere."
    if covers_hosts(hosts, shift):
        return (f"Sharded state: {len(hosts)} ranks on {len(set(hosts))} hosts; each commit's rows are copied to "
                f"rank + {shift}, on another host: one lost host loses nothing.")
    if len(set(hosts)) == 1:
        return (f"Sharded state: {len(hosts)} ranks on one host; each commit's rows are copied to the next rank: "
                "one lost rank loses nothing (the host lost needs --snapshot-dir).")
    busiest = max(sorted(set(hosts)), key=list(hosts).count)
    return (f"Sharded state: {len(hosts)} ranks on {len(set(hosts))} hosts; each commit's rows are copied to the next "
            f"rank: one lost rank loses nothing; {busiest} holds more than half of the ranks, so losing it needs "
            "--snapshot-dir.")
