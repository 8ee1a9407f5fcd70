"""One rank's commits of a sharded state, and a reset's restore of one into a new world.

A commit keeps this rank's rows of every sharded tensor (``own``) with the rest of the state
(the same on every rank), and a copy of the rows of the rank it covers (``held``). A commit
is taken in two phases, so that one rank lost at any moment leaves a whole commit among the
survivors, the new one or the one before:

1. *stage*: this rank's live rows go to its holder, and the covered rank's new rows arrive in
   a third buffer (``spare``), while ``own`` and ``held`` still hold the previous commit
   whole; the staged copy counts (is reported) only once its last byte is in;
2. *agree*: one small all-reduce, which completes only once every rank has staged;
3. *promote* (local): ``own`` <- the live rows, ``held`` <-> ``spare``. The previous copy,
   now in ``spare``, is still reported: gloo can complete the all-reduce on some ranks and
   not on others when a peer dies late, and a rank that did not promote has its new rows
   only in its live state, so the previous commit must stay whole until every rank promoted;
4. *settle*: a second all-reduce says every rank promoted; the previous commit is retired.

Two buffers cannot do this: while commit ``v`` is on the wire, the covered rank's ``v - 1``
rows (its only copy if it is the one lost), this rank's own ``v - 1`` rows and the incoming
``v`` rows all have to exist. So a rank keeps three shards of host memory: ``spare`` is
kept between commits (reusing it saves its page faults, as long again as the copy itself
on CPU). The first commit in a new layout (after a reset) also keeps the restored commit's
buffers of the old layout (``old``) until it has settled: until then, the restored commit
is what a loss falls back to.

``begin``, ``staged``, ``promote`` and ``settle`` change only this object (no I/O); ``save``
runs them around the messages, so a test can drive every rank's commit phase by phase.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.commit import collectives
from lightning_elastic.commit.collectives import Wait
from lightning_elastic.sharded import exchange, faults
from lightning_elastic.sharded.layout import NONE, Holding, Layout, Piece, Restore, Transfer, plan_transfers
from lightning_elastic.sharded.rows import Entry, RankRows
from lightning_elastic.training.state import to_host

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Buffer:
    """One rank's rows of a commit in host memory: ``version`` is NONE while they are being
    written (a torn buffer is never reported), or once nothing may be restored from them."""

    rows: RankRows
    layout: Layout
    version: int = NONE
    rest: Any = None  # with a rank's own rows: the rest of the state of that commit

    def piece(self, slot: str) -> Piece:
        return Piece(slot, self.layout, self.rows.rank, self.version, rest=self.rest is not None)


class ShardedCommit:
    def __init__(self) -> None:
        self.version = 0  # commits so far: the same count on every rank
        self.pinned = False  # page-locked host buffers (CUDA: faster copies to and from the device)
        self.own: Buffer | None = None
        self.held: Buffer | None = None
        self.spare: Buffer | None = None  # the copy being staged, or the one before ``held``
        self.old: list[Buffer] = []  # an older layout's commit, kept until one in this layout settled
        self._rest: Any = None  # the rest of the commit being staged

    # ----- what this rank holds --------------------------------------------------------------

    @property
    def layout(self) -> Layout | None:
        """The layout of this rank's newest own commit (None before the first)."""
        return self.own.layout if self.own is not None else None

    @property
    def own_version(self) -> int:
        return self.own.version if self.own is not None else NONE

    @property
    def own_rest(self) -> Any:
        return self.own.rest if self.own is not None else None

    def has(self, layout: Layout) -> bool:
        """A whole own commit in ``layout``."""
        return self.own is not None and self.own.layout == layout and self.own.version != NONE

    def buffers(self) -> dict[str, Buffer]:
        """Every buffer by slot name (what a ``Piece`` and a ``Transfer`` name)."""
        slots = {"own": self.own, "held": self.held, "spare": self.spare}
        slots.update((f"old{i}", b) for i, b in enumerate(self.old))
        return {slot: b for slot, b in slots.items() if b is not None}

    @property
    def nbytes(self) -> int:
        """Host bytes of the rows kept: own, the copies for the covered rank, an old layout's."""
        return sum(b.rows.nbytes for b in self.buffers().values())

    def holding(self) -> Holding:
        return Holding(tuple(b.piece(slot) for slot, b in self.buffers().items() if b.version != NONE))

    # ----- a commit, phase by phase (no I/O) ---------------------------------------------------

    def begin(self, entries: Sequence[Entry], rest: Any, layout: Layout, rank: int) -> RankRows | None:
        """Start commit ``version + 1``: the rest is copied to host memory, and the buffer the
        covered rank's rows are staged in is returned (None: one rank, no copy)."""
        entries = tuple(entries)
        if self.own is not None and (self.own.layout != layout or self.own.rows.entries != entries):
            # A new layout without a reset's restore (which keeps the restored commit as
            # ``old`` itself): the last commit of the old one stays until this one has settled.
            self.keep_only(self.own.layout, self.own.version)
        self._rest = to_host(rest)
        if not layout.shift:
            return None
        covered = layout.covered(rank)
        spare = self.spare
        if spare is None or spare.layout != layout or spare.rows.rank != covered or spare.rows.entries != entries:
            spare = self.spare = Buffer(RankRows(entries, covered, layout.world, pinned=self.pinned), layout)
        spare.version = NONE  # torn until its last byte is in
        return spare.rows

    def staged(self) -> None:
        """The covered rank's rows of this commit are all in."""
        if self.spare is not None and self.spare.version == NONE:
            self.spare.version = self.version + 1

    def promote(self, entries: Sequence[Entry], tensors: Sequence[torch.Tensor], layout: Layout, rank: int,
                keep_own: bool = True) -> None:
        """Every rank staged: the live rows become this rank's own commit, the staged copy the
        held one; the previous copy stays (in ``spare``) until ``settle``. ``keep_own=False``:
        the own buffer is still read elsewhere (a snapshot being written): a new one is made."""
        version = self.version + 1
        own = self.own
        if own is None or own.layout != layout or not keep_own:
            own = Buffer(RankRows(entries, rank, layout.world, pinned=self.pinned), layout)
        own.version = NONE
        with torch.no_grad():
            for index, tensor in enumerate(tensors):
                own.rows.view(index).copy_(tensor)
        own.rest, self._rest = self._rest, None
        own.version = version
        self.own = own
        if layout.shift:
            self.held, self.spare = self.spare, self.held
        self.version = version

    def settle(self) -> None:
        """Every rank promoted: the commit before is retired. The spare buffer is kept for the
        next commit's copy; an older layout's buffers are freed."""
        if self.spare is not None:
            self.spare.version = NONE
        self.old = []

    # ----- a commit, with its messages -----------------------------------------------------------

    def save(self, entries: Sequence[Entry], tensors: Sequence[torch.Tensor], rest: Any, layout: Layout,
             rank: int, device: torch.device, wait: Wait, keep_own: bool = True) -> None:
        """Commit ``tensors`` (this rank's live rows of ``entries``) and ``rest`` in ``layout``,
        collectively: every rank of the layout calls it at the same step. Raises if a peer
        is lost meanwhile; what this rank then holds is still reported exactly."""
        self.pinned = device.type == "cuda"
        stage = self.begin(entries, rest, layout, rank)
        if stage is not None:
            halfway = (lambda: faults.die_if_due("swap")) if faults.due("swap") else None
            exchange.send_rows(tensors, stage, layout.holder(rank), layout.covered(rank), device, halfway)
            self.staged()
            _barrier(device, wait)  # every rank staged
            faults.die_if_due("agreed")
        self.promote(entries, tensors, layout, rank, keep_own)
        if stage is not None:
            faults.die_if_due("promoted")
            _barrier(device, wait)  # every rank promoted
        self.settle()

    # ----- a reset ------------------------------------------------------------------------------

    def keep_only(self, layout: Layout, version: int) -> None:
        """Only commit ``version`` of ``layout`` can be restored from now on: every other buffer
        goes, and the kept ones wait (as ``old``) for the first commit in the next layout."""
        kept = [b for b in self.buffers().values() if b.layout == layout and b.version == version]
        self.own = self.held = self.spare = None
        self.old = kept

    def clear(self) -> None:
        """Nothing held can be restored (a fresh start, or a commit lost from memory)."""
        self.own = self.held = self.spare = None
        self.old = []

    def restore(self, choice: Restore, me: int, world: int, device: torch.device, wait: Wait,
                rebuild: Callable[[tuple[Entry, ...], Any], dict[int, torch.Tensor]]) -> tuple[Any, int]:
        """Member ``me`` of ``world``: receive the chosen commit's entries and rest from the
        member that has them, ``rebuild(entries, rest)`` the live state (returning its local
        rows by entry index), and move every row there. Returns ``(rest, bytes received)``;
        the rest is this member's own copy."""
        buffers = self.buffers()  # by the slot names the members reported (and the plan names)
        self.keep_only(choice.layout, choice.version)
        mine = None
        if me == choice.replicated_from:
            own = next(b for b in self.old if b.rest is not None)
            mine = (own.rows.entries, own.rest)
        entries, rest = (collectives.broadcast_object(mine, me, choice.replicated_from, device, wait)
                         if world > 1 else mine)
        if me == choice.replicated_from:
            rest = to_host(rest)  # the live values must not be the commit's own objects
        destinations = rebuild(entries, rest)
        transfers = plan_transfers(choice.sources, choice.layout.world, world, [e.rows for e in entries])

        def source(t: Transfer) -> torch.Tensor:
            rows = buffers[t.slot].rows
            assert rows.rank == t.old_rank, (t, rows.rank)
            return rows.view(t.entry)[t.src_row:t.src_row + t.rows]

        def destination(t: Transfer) -> torch.Tensor:
            return destinations[t.entry][t.dst_row:t.dst_row + t.rows]

        received = exchange.run_transfers(transfers, me, source, destination, device)
        self.version = choice.version
        return rest, received


def _barrier(device: torch.device, wait: Wait) -> None:
    """An all-reduce of nothing: it completes on a rank only once every rank has called it."""
    wait(dist.all_reduce(torch.zeros(1, device=device), async_op=True))
