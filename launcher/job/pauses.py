"""The driver's own absences: time it did not run is no worker's silence.

A driver stopped with Ctrl-Z (or SIGSTOP, a debugger, a suspended virtual machine, a
frozen container) serves no request meanwhile: every worker's heartbeat waits unanswered
in the driver's socket. Once it runs again, its loop would find every heartbeat older than
the timeout and SIGKILL the whole healthy job before the service has read the heartbeats
waiting for it. So the loop notes when it did not turn for longer than the heartbeat
interval (it turns every tick, 50 ms, when idle), and a worker's silence is counted from
the later of its last heartbeat and the end of that absence.

Starting workers (its lock released; 4,096 ssh starts take minutes) counts as turns, one
per start: the driver is busy then, not away. A loop pass that itself takes longer than
the heartbeat interval delays a wedged verdict by at most one timeout, the price of never
mistaking the driver's absence for the workers'.
"""

from __future__ import annotations

import logging

log = logging.getLogger("lightning_elastic.driver")


class Absences:
    """When the driver last came back from an absence longer than ``longer_than`` seconds."""

    def __init__(self, now: float, longer_than: float, warn_longer_than: float) -> None:
        self._longer_than = longer_than
        self._warn_longer_than = warn_longer_than
        self._last_turn = now
        self.back_at = now  # nothing before the driver started is anyone's silence either

    def turn(self, now: float) -> None:
        """The loop turned at ``now``."""
        away = now - self._last_turn
        self._last_turn = now
        if away <= self._longer_than:
            return
        self.back_at = now
        if away > self._warn_longer_than:
            log.warning("The driver did not run for %.1f s (stopped, suspended or starved of CPU): every worker's "
                        "heartbeat timeout starts again now.", away)

    def silent_for(self, since: float, now: float) -> float:
        """How long a worker last heard from at ``since`` has been silent while the driver ran."""
        return now - max(since, self.back_at)
