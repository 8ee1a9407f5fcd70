"""One rank's commit of a sharded state, and a reset's restore of it into a new world.

The commit holds this rank's rows of every sharded tensor (``own``), the rest of the state
(the same on every rank), and the copy of the rows of the rank it covers (``held``), with
the version of each: a copy being written reports no version until its last byte is in,
so a torn copy is never restored. Memory: two ranks' rows (its own and the one it holds)
in host buffers allocated once per layout, plus the small rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_elastic.commit import collectives
from lightning_elastic.commit.collectives import Wait
from lightning_elastic.sharded import exchange
from lightning_elastic.sharded.layout import NONE, Holding, Layout, Restore, Transfer, plan_transfers
from lightning_elastic.sharded.rows import Entry, RankRows
from lightning_elastic.training.state import to_host

log = logging.getLogger(__name__)


class ShardedCommit:
    def __init__(self) -> None:
        self.version = 0  # commits so far: the same count on every rank
        self.layout: Layout | None = None  # the layout of the commit held (own and held)
        self.own: RankRows | None = None
        self.own_rest: Any = None
        self.own_version = NONE
        self.held: RankRows | None = None
        self.held_version = NONE

    @property
    def nbytes(self) -> int:
        """Host bytes of the rows held: this rank's own plus the copy for its peer."""
        return sum(r.nbytes for r in (self.own, self.held) if r is not None)

    def save(self, entries: Sequence[Entry], tensors: Sequence[torch.Tensor], rest: Any, layout: Layout,
             rank: int, device: torch.device, keep_own: bool = True) -> None:
        """Commit ``tensors`` (this rank's rows of ``entries``) and ``rest``, then swap copies
        with the holder and the covered rank of ``layout``. ``keep_own=False``: the own buffer
        is still in use elsewhere (a snapshot being written): make a new one."""
        own, held = self.own, self.held
        if own is None or own.entries != tuple(entries) or self.layout != layout:
            # A new layout: both buffers go before new ones are made (two copies of the
            # rows at most, never four; the commit being replaced is lost meanwhile).
            self.own = self.held = own = held = None
        elif not keep_own:
            self.own = own = None
        pinned = device.type == "cuda"
        if own is None:
            own = self.own = RankRows(entries, rank, layout.world, pinned=pinned)
        self.layout = layout
        self.own_version = self.held_version = NONE  # torn until every byte is in
        with torch.no_grad():
            for index, tensor in enumerate(tensors):
                own.view(index).copy_(tensor)
        self.own_rest = to_host(rest)
        self.version += 1
        self.own_version = self.version
        if not layout.shift:
            self.held = None
            return
        covered = layout.covered(rank)
        if held is None:
            held = self.held = RankRows(entries, covered, layout.world, pinned=pinned)
        exchange.swap_copies(own.buffer, held.buffer, layout.holder(rank), covered, device)
        self.held_version = self.version

    def holding(self) -> Holding:
        if self.layout is None or self.own is None:
            return Holding(None)
        held_rank = self.held.rank if self.held is not None else NONE
        return Holding(self.layout, own_rank=self.own.rank if self.own_version != NONE else NONE,
                       own_version=self.own_version, held_rank=held_rank,
                       held_version=self.held_version if held_rank != NONE else NONE)

    def restore(self, choice: Restore, me: int, world: int, device: torch.device, wait: Wait,
                rebuild: Callable[[tuple[Entry, ...], Any], dict[int, torch.Tensor]]) -> tuple[Any, int]:
        """Member ``me`` of ``world``: receive the chosen commit's entries and rest from the
        member that has them, ``rebuild(entries, rest)`` the live state (returning its local
        rows by entry index), and move every row there. Returns ``(rest, bytes received)``;
        the rest is this member's own copy."""
        mine = (self.own.entries, self.own_rest) if me == choice.replicated_from and self.own is not None else None
        entries, rest = (collectives.broadcast_object(mine, me, choice.replicated_from, device, wait)
                         if world > 1 else mine)
        if me == choice.replicated_from:
            rest = to_host(rest)  # the live values must not be the commit's own objects
        destinations = rebuild(entries, rest)
        transfers = plan_transfers(choice.sources, choice.layout.world, world, [e.rows for e in entries])

        def source(t: Transfer) -> torch.Tensor:
            rows = self.held if t.held else self.own
            assert rows is not None and rows.rank == t.old_rank, (t, rows and rows.rank)
            return rows.view(t.entry)[t.src_row:t.src_row + t.rows]

        def destination(t: Transfer) -> torch.Tensor:
            return destinations[t.entry][t.dst_row:t.dst_row + t.rows]

        received = exchange.run_transfers(transfers, me, source, destination, device)
        self.version = choice.version
        return rest, received
