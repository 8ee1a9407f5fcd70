"""The collective-error rules: is a member's error a lost peer (recover from the last commit)
or its own (re-raise it), and has the same collective error ended too many rounds?

Pure functions of what the driver knows when a member asks (``ErrorView``): the service
builds the view under the job's lock and answers with what ``classify_error`` returns.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from lightning_elastic.launcher.job.state import RoundBreak
from lightning_elastic.protocol import RoundLostReply

# An error is compared by its first characters (numbers masked): the worker sends its last
# traceback line, and nothing from the network is kept unbounded.
MAX_ERROR_CHARS = 500


def normalize_error(text: str) -> str:
    """An error message with its numbers masked: ports, addresses and times differ between rounds."""
    return re.sub(r"0x[0-9a-fA-F]+|[0-9]+", "#", text).strip()


def repeated_collective_error(breaks: Sequence[RoundBreak], limit: int) -> str | None:
    """The job-ending message when the last ``limit`` rounds all ended with the same
    collective error, among the same members, without a single commit; else None.

    A lost peer ends a round too, but costs a host (it is blacklisted), so it cannot repeat
    without bound; a collective error without an exit can. ``limit`` 0 turns this off.
    """
    if limit <= 0 or len(breaks) < limit:
        return None
    last = breaks[-limit:]
    first = last[0]
    key = normalize_error(first.error)
    for previous, current in zip(last, last[1:]):
        if current.round != previous.round + 1:
            return None
    if not first.error or any(
        not b.error or normalize_error(b.error) != key or b.slots != first.slots or b.commits for b in last
    ):
        return None
    return (
        f"the same collective error ended {limit} consecutive rounds ({first.round}-{last[-1].round}) "
        f"with no commit in between: {last[-1].error}"
    )


@dataclasses.dataclass(frozen=True)
class ErrorView:
    """What the driver knows when a member asks about an error it caught in its round."""

    broken: bool  # the round lost a member: one exited, was killed, left, or had a collective error
    judged_own: bool  # every live member once asked at the same time: the same error everywhere
    all_members_asking: bool  # every live member of the round is asking now
    collective: bool  # the asker's error is a collective failure by its type
    repeated_error: str | None  # the same collective error ended too many rounds
    waited_out: bool  # the asker's bounded wait is over
    # A member of the round was told its error is its own, the same error as the asker's
    # (numbers aside): the asker raised it too, only later.
    failed_alike: bool = False
    # ... a different error: that member is leaving the round, which is lost to the asker.
    failed_other: bool = False
    # Every other live member sent a request after the asker's question: none was lost
    # when the asker raised.
    others_alive: bool = False
    # A live member of the round has sent the driver nothing since the asker's question: it
    # may be dead on a machine whose exit the driver cannot see (a crashed node's srun or
    # ssh lingers), its gloo error the asker's. Its heartbeat timeout will tell.
    peer_silent: bool = False
    # The asker's whole wait is over: --error-wait, and the wait for the driver's verdict
    # on a silent peer (its heartbeat timeout and a grace, from the question).
    out_of_time: bool = False


def classify_error(view: ErrorView) -> RoundLostReply | None:
    """The answer to a member's error, or None to wait for more facts.

    "Lost" (recover from the last commit) when the round is broken, or a member of it was
    told its own, different, error is its own (it is leaving); a collective error broke the
    round itself, so it is recovered from unless it keeps repeating. "Own error" when every
    live member asks (the same error everywhere: the user's), when a member already failed
    with the same error (the same, raised a little later), when every other member showed
    it is alive after the question (no peer was lost: peers that raise the same error later
    are caught by the previous rule), else after the wait, --error-wait: at its end, unless
    a peer has been silent since the question. That peer is dead or cut off, or alive and
    slow to say so; the driver decides which within its heartbeat timeout (a verdict breaks
    the round: "lost"), so the answer waits for that, bounded (``out_of_time``).
    """
    if view.collective:
        if view.repeated_error is not None:
            return RoundLostReply(False, view.repeated_error)
        return RoundLostReply(True)
    if view.judged_own or view.failed_alike:
        return RoundLostReply(False)
    if view.broken or view.failed_other:
        return RoundLostReply(True)
    if view.all_members_asking or view.others_alive or view.out_of_time:
        return RoundLostReply(False)
    if view.waited_out and not view.peer_silent:
        return RoundLostReply(False)
    return None
