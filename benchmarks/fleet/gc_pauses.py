"""Every garbage collection in this process: (monotonic start, seconds, generation).

Used by the driver's process and by the simulator's: CLOCK_MONOTONIC is the machine's, so
the simulator can place each pause, of either process, in its own phases (during a
re-formation, in steady state). Bounded: the first MAX are kept.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    MAX = 100_000

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._started = now
        elif len(self.pauses) < self.MAX:
            self.pauses.append((self._started, now - self._started, info["generation"]))
