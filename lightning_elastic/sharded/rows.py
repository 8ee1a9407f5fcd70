"""One rank's committed rows of every sharded tensor, in one flat host buffer.

A sharded state's tensors (``Entry``: a parameter, or one of an optimizer's moments of it)
are laid out one after the other, each holding the rows ``layout.rows_of`` gives the rank.
One flat buffer, not one tensor per entry: the copy for a peer travels as one message, a
rank's part of a snapshot is one stretch of memory, and freeing it is one call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from lightning_elastic.sharded.layout import rows_of

_ALIGN = 64  # bytes: every entry starts aligned, so a byte slice can be viewed as its dtype


@dataclasses.dataclass(frozen=True)
class Entry:
    """A sharded tensor of the state: its path in the state (``("model", fqn)`` or
    ``("optimizer", fqn, name)``), global shape and dtype."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class RankRows:
    """The rows rank ``rank`` holds at world ``world`` of every entry, in one host buffer."""

    def __init__(self, entries: Sequence[Entry], rank: int, world: int, pinned: bool = False) -> None:
        self.entries = tuple(entries)
        self.rank, self.world = rank, world
        self._spans: list[tuple[int, int, int]] = []  # (byte offset, first row, row count)
        offset = 0
        for entry in self.entries:
            start, stop = rows_of(rank, world, entry.rows)
            self._spans.append((offset, start, stop - start))
            offset += -(-(stop - start) * entry.row_bytes // _ALIGN) * _ALIGN
        self.buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pinned)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def first_row(self, index: int) -> int:
        return self._spans[index][1]

    def view(self, index: int) -> torch.Tensor:
        """Entry ``index``'s rows here, as a tensor of its dtype (rows x the rest of its shape)."""
        entry = self.entries[index]
        offset, _, count = self._spans[index]
        raw = self.buffer[offset:offset + count * entry.row_bytes]
        return raw.view(entry.dtype).view(count, *entry.shape[1:]) if entry.shape else raw.view(entry.dtype)
