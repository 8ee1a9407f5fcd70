"""A list for a job of weeks: its first and its newest entries kept, the rest only counted.

The summary lists every failure and every round's world size; a job that loses a worker
an hour for a month has 720 of each, one replacing a failing host every few seconds
hundreds of thousands. The first entries say how the job went wrong, the newest how it
ended; ``events.jsonl`` keeps all of them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedHistory(Generic[T]):
    FIRST, NEWEST = 20, 80  # entries kept from the start and from the end

    def __init__(self, first: int = FIRST, newest: int = NEWEST) -> None:
        self._first: list[T] = []
        self._newest: collections.deque[T] = collections.deque(maxlen=newest)
        self._first_limit = first
        self.total = 0  # every entry ever appended

    @classmethod
    def of(cls, items: Iterable[T], omitted: int = 0) -> BoundedHistory[T]:
        """The history a previous driver kept: its ``items`` (first and newest) and how many
        it had ``omitted`` between them."""
        history: BoundedHistory[T] = cls()
        for item in items:
            history.append(item)
        history.total += max(0, omitted)
        return history

    def append(self, item: T) -> None:
        self.total += 1
        if len(self._first) < self._first_limit:
            self._first.append(item)
        else:
            self._newest.append(item)

    @property
    def omitted(self) -> int:
        """Entries between the first and the newest kept, no longer held."""
        return self.total - len(self._first) - len(self._newest)

    @property
    def last(self) -> T | None:
        if self._newest:
            return self._newest[-1]
        return self._first[-1] if self._first else None

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[T]:
        yield from self._first
        yield from self._newest
