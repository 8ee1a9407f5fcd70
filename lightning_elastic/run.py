"""``@run``: the elastic retry loop around a training function."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.errors import CollectiveError, HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.state import State
from lightning_elastic.worker import ElasticWorker

log = logging.getLogger(__name__)

R = TypeVar("R")


def is_collective_failure(err: BaseException, worker: ElasticWorker) -> bool:
    """Was ``err`` caused by a lost peer rather than by the user's code?

    gloo reports a dead peer as a plain RuntimeError, just like a user's bug would be, so
    the message is not trusted: the driver, which saw its processes exit, decides. torch's
    own distributed errors (DistError: NCCL's DistBackendError, timeouts) and our
    CollectiveError are collective failures whatever the driver says.
    """
    if isinstance(err, (CollectiveError, dist.DistError)):
        return True
    return worker.round_lost_member()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Run ``func(state, ...)`` elastically.

    Before the first call and after every reset, every rank takes rank 0's state (decided
    the same way on all ranks: always) and commits it. A lost peer restores the last commit;
    a host-change interrupt keeps the live state. Then the worker re-joins at the next round,
    runs the reset callbacks, syncs and calls ``func`` again. Any other error is the user's:
    it is reported to the driver and re-raised, ending this worker with its traceback.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        worker = state.worker
        needs_reset = False
        while True:
            try:
                if needs_reset:
                    worker.reset()
                    state.on_reset()
                state.sync()
                state.save()
                result = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as err:
                log.info("Rank %d: %s; re-forming the group with live state.", worker.assignment.rank, err)
                needs_reset = True
                continue
            except RendezvousError:
                raise  # the driver is gone or gave up on us: nothing to retry with
            except Exception as err:
                if is_collective_failure(err, worker):
                    log.warning(
                        "Rank %d: round %d lost a member (%s); restoring the last commit.",
                        worker.assignment.rank, worker.assignment.round, str(err).splitlines()[0][:200],
                    )
                    state.restore()
                    needs_reset = True
                    continue
                worker.report(p.Outcome.FAILED, describe_error(err))
                raise
            worker.report(p.Outcome.DONE)
            return result

    return wrapper


def describe_error(err: BaseException) -> str:
    """The last line of the traceback: what the driver prints as the worker's failure."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return last[:500]
