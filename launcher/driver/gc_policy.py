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

While a round re-forms (a round broke, or a host change was announced, until the next
round forms) there is no collection at all, for at most ``REFORM_HOLD`` seconds: every
member comes back at once, and even the young collections of that burst (12-13 of them,
0.21-0.27 s in all at 4,096 workers, the longest ~0.1 s) stopped the service while the
fleet waited on it. What the burst leaves is frozen with the new round, or collected as
usual if the hold runs out first.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

YOUNG_THRESHOLD = 20_000  # allocations between young collections (CPython's default: 700)
REFRESH_AFTER = 600.0  # seconds without a round formed before the frozen heap is collected
REFORM_HOLD = 5.0  # longest a re-formation goes without collections


class ServiceGc:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._saved: tuple[int, int, int] | None = None
        self._frozen_at: float | None = None
        self._held_since: float | None = None  # collections off while a round re-forms
        self._reforming = False  # one hold per re-formation, even if it runs out

    def start(self) -> None:
        """The driver's services are up: what exists now (imports, configuration) stays."""
        self._saved = gc.get_threshold()
        _, middle, old = self._saved
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
        self._freeze()

    def round_formed(self) -> None:
        """The round's records, assignments and connections are the job's long-lived heap."""
        self._release()
        self._reforming = False
        self._freeze()

    def reforming(self) -> None:
        """A round is re-forming: no collection until it has formed (``round_formed``) or
        for REFORM_HOLD seconds (``tick``). Called again while it lasts: no effect."""
        if self._saved is not None and not self._reforming and gc.isenabled():
            self._reforming = True
            self._held_since = self._clock()
            gc.disable()

    def tick(self) -> None:
        """From the driver's loop: end a hold that ran out; renew the freeze once the job
        has been quiet long enough (never while a round re-forms: that is one full pause)."""
        if self._held_since is not None and self._clock() - self._held_since >= REFORM_HOLD:
            self._release()
        if not self._reforming and self._frozen_at is not None and self._clock() - self._frozen_at >= REFRESH_AFTER:
            gc.unfreeze()
            gc.collect()
            self._freeze()

    def stop(self) -> None:
        self._release()
        self._reforming = False
        gc.unfreeze()
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        self._frozen_at = None

    def _freeze(self) -> None:
        gc.freeze()
        self._frozen_at = self._clock()

    def _release(self) -> None:
        if self._held_since is not None:
            self._held_since = None
            gc.enable()
