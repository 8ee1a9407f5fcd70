"""Lines that stay lines at fleet scale."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def listing(items: Sequence[T], show: Callable[[T], str] = str, limit: int = 16) -> str:
    """At most ``limit`` items, then how many more: a line of the driver's log stays a
    line at 4,096 workers (the whole list made ~100 KB lines), and only the items shown
    are formatted."""
    shown = [show(item) for item in itertools.islice(items, limit)]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more else "")
