"""``@run``: the elastic retry loop around a hand-written training function."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_elastic.training.recovery import RetryEngine
from lightning_elastic.training.state import State

R = TypeVar("R")

log = logging.getLogger(__name__)


class _StateRecovery:
    """How ``@run`` recovers a ``State``: commits in host memory, rank 0's state for all."""

    def __init__(self, state: State, call: Callable[[], R]) -> None:
        self._state = state
        self._call = call
        self._restored = False  # the last recovery restored the commit (a failure, not a host change)
        self._said_no_commit = False

    def before_rejoin(self) -> None:
        pass

    def prepare(self, resumed: bool) -> None:
        # Before the first call and after every reset, every rank takes rank 0's state as its
        # live state and its commit, so a failure during the next attempt comes back here.
        # A job resuming from a durable snapshot runs the reset callbacks too: the world
        # size may differ from the one that wrote it.
        # Until a round has synced, whoever is rank 0 loads it (the first rank 0 may be lost
        # before its state reached anyone).
        if self._state.resume_from_snapshot() is not None:
            resumed = True
        if resumed:
            self._state.on_reset()
        self._state.sync()
        self._state.worker.resume_from = None  # synced: every rank holds the resumed state
        if self._restored:
            self._restored = False
            self._hint_if_nothing_was_committed()

    def _hint_if_nothing_was_committed(self) -> None:
        # A loop that never calls state.commit() loses everything at each failure, silently:
        # said once, by rank 0, when the commit restored is the state as it was constructed.
        # ``_commits`` is the job's count (it travels with each commit): not this process's.
        if self._said_no_commit or getattr(self._state, "_commits", None) != 0:
            return
        self._said_no_commit = True
        if self._state.worker.assignment.rank == 0:
            log.warning("Rank 0: the restored commit is the state as it was constructed: nothing was committed "
                        "since training started, so its values start over. Call state.commit() every few batches "
                        "(le.ElasticCallback does it for Lightning) to lose only the batches since the last.")

    def attempt(self) -> R:
        return self._call()

    def keep_live_state(self) -> None:
        # Every rank stopped at the same step: the live state is consistent, and a peer lost
        # during the re-formation must not roll it back to an older commit.
        self._state.keep_live()

    def restore_commit(self) -> None:
        self._state.restore()
        self._restored = True


def run(func: Callable[..., R] | None = None) -> Callable[..., R]:
    """Run ``func(state, ...)`` elastically (see ``lightning_elastic.training.recovery``).

    A lost peer restores the last commit; a host change keeps the live state; either way the
    worker joins the next round, runs the reset callbacks, takes rank 0's state and calls
    ``func`` again. Any other error is the user's: reported to the driver and re-raised.
    """
    if not callable(func):
        # @le.run() or le.run(state): the decorator takes the training function itself.
        got = "nothing" if func is None else type(func).__name__
        raise TypeError(
            f"@le.run: expected the training function, got {got}: write @le.run (no parentheses) "
            "above def train(state, ...), then call train(state)"
        )
    name = getattr(func, "__qualname__", repr(func))

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        state, rest = (args[0], args[1:]) if args else (kwargs.pop("state", None), ())
        if not isinstance(state, State):
            # Without this, the first use of ``state.worker`` raises an AttributeError that
            # names neither @le.run nor the state.
            got = "no argument" if state is None and not args else type(state).__name__
            method = state is not None and hasattr(type(state), func.__name__)  # self came first
            raise TypeError(
                f"{name}, decorated with @le.run, takes a lightning_elastic state as its first argument "
                f"(le.TorchState, le.ObjectState, le.FabricState), got {got}: call {func.__name__}(state, ...)"
                + ("; on a method, decorate a function whose first argument is the state" if method else "")
            )
        recovery = _StateRecovery(state, lambda: func(state, *rest, **kwargs))
        return RetryEngine(state.worker, recovery).run()

    return wrapper
