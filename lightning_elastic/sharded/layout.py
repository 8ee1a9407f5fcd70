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
lost rank. A commit in progress keeps the previous one whole until every rank has the new
one (``commit.ShardedCommit``), so a member may hold pieces of two commits, and of two
layouts (the first commit after a reset): each whole piece is reported (``Piece``).

At a reset every member says what it holds (``Holding``); ``choose_commit`` picks the
newest commit of which every rank of its layout is still held somewhere, and lists the
row ranges each new rank receives from which member (``plan_transfers``), read from the own copy
of the rank that committed them when it survives, else from a copy another member holds.
Nothing here touches torch.distributed: the same plan is computed on every member from the
same gathered holdings, so every member posts the same transfers.
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
class Piece:
    """Old rank ``rank``'s whole rows of commit ``version`` of ``layout``, in the member's
    buffer ``slot``; ``rest``: with that commit's rest of the state (a rank's own copy).
    A buffer being written is never a piece: it becomes one when its last byte is in."""

    slot: str
    layout: Layout
    rank: int
    version: int
    rest: bool = False


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one member of the new round holds (sent to every member at a reset): its whole
    pieces, none for a joiner."""

    pieces: tuple[Piece, ...] = ()


@dataclasses.dataclass(frozen=True)
class Source:
    """Where old rank ``rank``'s committed rows are read: member ``member``'s buffer ``slot``."""

    member: int
    slot: str


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows ``[src_row, src_row + rows)`` of old rank ``old_rank``'s part of tensor ``entry``,
    read from buffer ``slot`` of member ``src``, written at row ``dst_row`` of member
    ``dst``'s new part of that tensor."""

    entry: int
    src: int
    slot: str
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


def _pieces(holdings: Sequence[Holding], layout: Layout, version: int) -> list[tuple[int, Piece]]:
    return [(member, piece) for member, h in enumerate(holdings) for piece in h.pieces
            if piece.layout == layout and piece.version == version]


def _sources(holdings: Sequence[Holding], layout: Layout, version: int) -> list[Source] | None:
    found: dict[int, Source] = {}
    pieces = _pieces(holdings, layout, version)
    for member, piece in sorted(pieces, key=lambda mp: not mp[1].rest):  # an own copy is preferred
        found.setdefault(piece.rank, Source(member, piece.slot))
    if len(found) < layout.world:
        return None
    return [found[r] for r in range(layout.world)]


def _missing(holdings: Sequence[Holding], layout: Layout, version: int) -> list[int]:
    have = {piece.rank for _, piece in _pieces(holdings, layout, version)}
    return [r for r in range(layout.world) if r not in have]


def choose_commit(holdings: Sequence[Holding]) -> Restore | Fresh | Lost:
    """What the members (``holdings`` in new-rank order) restore, and from whom.

    The newest version wins of which every rank of its layout is held by some member, and
    some member holds its rest; a member's own copy is read before another's copy of the
    same rows. Only whole pieces are reported, so a commit torn by a loss is never chosen.
    """
    candidates = sorted({(p.version, p.layout) for h in holdings for p in h.pieces},
                        key=lambda c: (c[0], c[1].round), reverse=True)
    if not candidates:
        return Fresh()
    for version, layout in candidates:
        sources = _sources(holdings, layout, version)
        if sources is None:
            continue
        replicated_from = next((m for m, piece in _pieces(holdings, layout, version) if piece.rest), NONE)
        if replicated_from == NONE:
            continue  # rows alone, and nobody with the rest of that commit
        return Restore(layout, version, tuple(sources), replicated_from)
    # The commit that came closest (a newer one torn mid-commit names more ranks than it lost).
    version, layout = min(candidates, key=lambda c: len(_missing(holdings, c[1], c[0])))
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
                out.append(Transfer(entry=entry, src=s.member, slot=s.slot, old_rank=old_rank, src_row=start - a,
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
