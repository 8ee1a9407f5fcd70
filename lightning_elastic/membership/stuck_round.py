"""A member still in a round that lost a member, long after that round's connections were cut.

When a round loses a member, the heartbeat thread shuts down the round's gloo connections
(``group_sockets``), and a collective waiting on a lost peer fails at once. Twice (once in
CI, once in 19 goodput trials) a survivor nevertheless stayed in the broken round, training
no further and never coming back to the rendezvous, while its heartbeats told the driver
it was alive: the job then waited for the driver's ``--start-timeout`` (600 s by default).
Where it was stuck is unknown: neither run kept a stack.

So the heartbeat watches: ``warn_after`` seconds after the cut, a worker whose main thread
is still in the broken round shuts the connections down again and prints where that thread
is (the next occurrence says where); ``exit_after`` seconds after the cut it exits with a
line that says why, and the job goes on without it, as after any lost worker. A member
that is legitimately away from collectives that long (a validation batch of minutes
without a host-update check) is the price of the bound; such a worker would hold its peers
waiting in the rendezvous all that time anyway.
"""

from __future__ import annotations

import enum
import sys
import traceback

WARN_AFTER_S = 10.0
EXIT_AFTER_S = 120.0


class Action(enum.Enum):
    NONE = "none"
    REPORT = "report"  # cut again, and say where the main thread is
    EXIT = "exit"


class StuckRoundWatch:
    """Time since the broken round's connections were cut, while the main thread stays in it."""

    def __init__(self, warn_after: float = WARN_AFTER_S, exit_after: float = EXIT_AFTER_S) -> None:
        self._warn_after = warn_after
        self._exit_after = exit_after
        self._cut: tuple[int, float] | None = None  # (round, when its connections were cut)
        self._reported = False

    def cut(self, round_: int, now: float) -> None:
        if self._cut is None or self._cut[0] != round_:
            self._cut = (round_, now)
            self._reported = False

    def check(self, group_round: int, now: float) -> Action:
        """``group_round``: the round of the group that stands now (0 while none does)."""
        if self._cut is None:
            return Action.NONE
        round_, since = self._cut
        if group_round != round_:  # the main thread left it: reset as it should
            self._cut = None
            return Action.NONE
        waited = now - since
        if waited >= self._exit_after:
            return Action.EXIT
        if waited >= self._warn_after and not self._reported:
            self._reported = True
            return Action.REPORT
        return Action.NONE

    def waited(self, now: float) -> float:
        """Seconds since the cut the watch is acting on (0 while it watches none)."""
        return now - self._cut[1] if self._cut is not None else 0.0


def stack_of(thread_ident: int | None) -> str:
    """Where the thread is, as a traceback (innermost last), or why that is not known."""
    frame = sys._current_frames().get(thread_ident) if thread_ident is not None else None  # noqa: SLF001
    if frame is None:
        return "  (its stack is not available)\n"
    return "".join(traceback.format_stack(frame))
