"""Test helper: ``python late_replies.py launch ARGS...`` is ``lightning-elastic launch ARGS...``
whose rendezvous service answers every woken request ``LATE_S`` late.

On a loaded machine the service's event loop may read a woken request's answer only after
the driver's next decision pass (its tick is 50 ms), and that pass may have changed the
answer. The rolling move failed so about one run in a few in CI: the holder of the state,
let go in the pass after the round with the joiner formed, was sent EXIT instead of that
round. Here every woken answer is read that late, so a test sees that order every run.
"""

import sys

from lightning_elastic.launcher.cli import main
from lightning_elastic.launcher.service import long_poll

LATE_S = 0.3

_wake = long_poll.LoopWaker._wake


def _late_wake(self: long_poll.LoopWaker, future) -> None:
    # From any thread, as _wake itself: the loop resolves the future LATE_S from now. A poll's
    # own deadline timer is left alone (a wait that ends on time ends on time).
    self._loop.call_soon_threadsafe(self._loop.call_later, LATE_S, _wake, self, future)


if __name__ == "__main__":
    long_poll.LoopWaker._wake = _late_wake
    sys.exit(main(sys.argv[1:]))
