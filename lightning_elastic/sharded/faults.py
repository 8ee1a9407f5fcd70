"""Test-only fault injection: a sharded commit that SIGKILLs its own process at a chosen point.

A worker whose environment has ``LIGHTNING_ELASTIC_TEST_SIGKILL_IN_COMMIT=PHASE`` kills
itself with a real SIGKILL when its next sharded commit reaches ``PHASE``:

* ``swap``: after half of its rows went to its holder (the holder's copy stays torn);
* ``agreed``: after every rank's copy was agreed complete, before this rank promotes it;
* ``promoted``: after promoting, before the barrier that retires the previous commit.

Read at each point, not at import, so a test (``examples/sharded_loop.py --sigkill-in-commit``)
sets it in the one process that must die, just before that commit.
"""

from __future__ import annotations

import os
import signal

ENV = "LIGHTNING_ELASTIC_TEST_SIGKILL_IN_COMMIT"
PHASES = ("swap", "agreed", "promoted")


def due(phase: str) -> bool:
    """Whether this process dies at ``phase`` of its commit."""
    value = os.environ.get(ENV, "")
    if value and value not in PHASES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(PHASES)}")
    return value == phase


def die_if_due(phase: str) -> None:
    if due(phase):
        os.kill(os.getpid(), signal.SIGKILL)
