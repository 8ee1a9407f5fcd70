"""Garbage collection in the driver: no full collection while a round forms.

The driver holds a large, long-lived heap at fleet scale: a record, a signal and two
connections (transport, protocol, buffers) per worker, hundreds of thousands of objects
tracked by the collector at 4,096 workers. CPython's defaults (a young collection every
700 allocations, a full one every 100 young ones, give or take) walk all of it in a full
collection: measured with the fleet simulation, 3-4 full collections of up to 276 ms, and
~0.85 s of collections in all, fell within one re-formation at 4,096 workers, which
allocates a burst of replies and assignments. That pause stops the service and the loop
alike.

So: young collections less often (every 20,000 allocations: each stays short, as young
objects are few), and the job's long-lived objects frozen (``gc.freeze``: moved out of the
collector's sight) once they exist, after each round forms, so a full collection walks
only what is new. Frozen objects are still freed by reference counting; only cyclic
garbage among them would wait, so the freeze is renewed, by one collection of everything,
when the job has been quiet (no round formed) for ``REFRESH_AFTER`` seconds: a bounded
leak, one pause at a time when nothing waits on the driver.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

YOUNG_THRESHOLD = 20_000  # allocations between young collections (CPython's default: 700)
REFRESH_AFTER = 600.0  # seconds without a round formed before the frozen heap is collected


class ServiceGc:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._saved: tuple[int, int, int] | None = None
        self._frozen_at: float | None = None

    def start(self) -> None:
        """The driver's services are up: what exists now (imports, configuration) stays."""
        self._saved = gc.get_threshold()
        _, middle, old = self._saved
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
        self._freeze()

    def round_formed(self) -> None:
        """The round's records, assignments and connections are the job's long-lived heap."""
        self._freeze()

    def tick(self) -> None:
        """From the driver's loop: renew the freeze once the job has been quiet long enough."""
        if self._frozen_at is not None and self._clock() - self._frozen_at >= REFRESH_AFTER:
            gc.unfreeze()
            gc.collect()
            self._freeze()

    def stop(self) -> None:
        gc.unfreeze()
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        self._frozen_at = None

    def _freeze(self) -> None:
        gc.freeze()
        self._frozen_at = self._clock()
