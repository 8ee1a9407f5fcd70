"""Waiting for an asynchronous gloo collective of a round that may have lost a member.

gloo fails a pending receive when its peer goes away, but not always a pending send: the
root of a broadcast whose receivers left it can wait in the send for the group's whole
timeout (30 minutes by default) with every connection of the group already closed. So a
collective still pending a short grace after the driver said its round lost a member is
given up (``CollectiveError``), and the round's group is then left without being destroyed
(the destroy would wait for the stuck send). The history is in docs/reliability.md.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from lightning_elastic.errors import CollectiveError

# How often a pending collective looks whether its round broke, and how long it may stay
# pending once the round is known broken (the heartbeat has then cut the group's
# connections: an operation gloo did fail has raised well within this).
COLLECTIVE_WAIT_SLICE = datetime.timedelta(seconds=0.25)
ABANDON_AFTER_BROKEN_S = 2.0


def wait_or_give_up(
    work: dist.Work, broken_reason: Callable[[], str | None],
    wait_slice: datetime.timedelta = COLLECTIVE_WAIT_SLICE, grace_s: float = ABANDON_AFTER_BROKEN_S,
    give_up_after_s: float | None = None,
) -> None:
    """``work.wait()``, but raise ``CollectiveError`` once ``broken_reason()`` has named a
    reason for ``grace_s`` seconds and the work is still pending, or once the work has been
    pending for ``give_up_after_s`` seconds (if given)."""
    broken_since: float | None = None
    started = time.monotonic()
    while True:
        try:
            work.wait(wait_slice)
            return
        except RuntimeError:
            if work.is_completed():
                # Failed, or completed just after the slice ran out (the error raised is then
                # the slice's own "Operation timed out!"): a wait now, on completed work,
                # returns or raises the operation's own error, e.g. a lost peer's.
                work.wait()
                return
        if give_up_after_s is not None and time.monotonic() - started >= give_up_after_s:
            raise CollectiveError(f"a collective was still pending {give_up_after_s:g} s later and was given up")
        reason = broken_reason()
        if reason is None:
            continue
        now = time.monotonic()
        broken_since = now if broken_since is None else broken_since
        if now - broken_since >= grace_s:
            raise CollectiveError(f"{reason}; a collective of its group was still pending {grace_s:g} s later "
                                  "and was given up")
