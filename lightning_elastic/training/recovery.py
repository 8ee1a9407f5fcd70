"""The one retry engine behind ``@run`` and the Lightning fit loop.

An attempt at the training function ends in one of four ways:

* it returns: the worker reports success to the driver;
* ``HostsUpdatedInterrupt`` (hosts were added or removed, or a peer is leaving on a
  preemption notice; raised on every rank at the same step): the live state is kept;
* an error the driver classes as a lost peer: the last commit is restored;
* any other error is the user's: reported to the driver and re-raised with its traceback.

After the second and third, the worker leaves its round, joins the next one, and the
``Recovery`` prepares the new world (reset callbacks, state broadcast, agreement on what
to resume from). Every one of those steps runs inside the same ``try`` as the attempt
itself: a peer lost while the group re-forms starts another recovery, it never fails a
healthy worker. Whether an error is a lost peer is the driver's decision
(``ElasticWorker.classify_error``), made from what it saw of the round's members.
"""

from __future__ import annotations

import logging
import traceback
from typing import Generic, Protocol, TypeVar

import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.errors import CollectiveError, DriverUnreachable, HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.membership.client import exit_driver_gone

log = logging.getLogger(__name__)

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Member(Protocol):
    """What the engine needs of the worker (``ElasticWorker``; fakes in unit tests)."""

    @property
    def assignment(self) -> p.Assignment: ...

    def reset(self) -> None: ...

    def classify_error(self, error: str, collective: bool) -> p.RoundLostReply: ...

    def report(self, outcome: p.Outcome, message: str = "") -> None: ...

    in_retry_loop: bool  # set here: the process's training runs in a retry loop


class Recovery(Protocol[R_co]):
    """The parts of a training run the engine drives; each API supplies its own."""

    def before_rejoin(self) -> None:
        """Release what the interrupted attempt held (Lightning: the trainer's teardown)."""

    def prepare(self, resumed: bool) -> None:
        """Collectives of a new round: reset callbacks, state broadcast, agreement."""

    def attempt(self) -> R_co:
        """One call of the training function."""

    def keep_live_state(self) -> None:
        """A host change interrupted the attempt: the live state becomes the rollback point."""

    def restore_commit(self) -> None:
        """A peer was lost: go back to the last commit."""


def is_collective_error(err: BaseException) -> bool:
    """A collective failure by its type: torch's DistError (NCCL errors, timeouts) or ours.

    gloo reports a dead peer as a plain RuntimeError, like a user's bug; those are told
    apart by the driver alone.
    """
    return isinstance(err, (CollectiveError, dist.DistError))


def describe_error(err: BaseException) -> str:
    """The last line of the traceback: what the driver prints as the worker's failure."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return p.clip(last, 500)  # at a word boundary: it ends up in the job's one-line verdict


class RetryEngine(Generic[R]):
    def __init__(self, worker: Member, recovery: Recovery[R]) -> None:
        self._worker = worker
        self._recovery = recovery

    def run(self) -> R:
        worker, recovery = self._worker, self._recovery
        worker.in_retry_loop = True
        resumed = False
        while True:
            try:
                if resumed:
                    self._release(recovery)
                    worker.reset()
                recovery.prepare(resumed)
                result = recovery.attempt()
            except HostsUpdatedInterrupt as err:
                log.info("Rank %d: %s; re-forming with the live state.", worker.assignment.rank, err)
                recovery.keep_live_state()
                resumed = True
                continue
            except DriverUnreachable as err:
                exit_driver_gone(err.waited)  # as the heartbeat thread would: not a failure of this worker
            except RendezvousError:
                raise  # the driver gave up on this worker: nothing to retry with
            except Exception as err:
                try:
                    decision = worker.classify_error(describe_error(err), is_collective_error(err))
                except DriverUnreachable as gone:  # asked the driver about the error: it is gone
                    exit_driver_gone(gone.waited)
                if not decision.lost:
                    message = describe_error(err)
                    if decision.reason:
                        message += f" ({decision.reason})"
                    worker.report(p.Outcome.FAILED, message)
                    raise
                log.warning(
                    "Rank %d: round %d is broken (here: %s); restoring the last commit.",
                    worker.assignment.rank, worker.assignment.round, _first_line(err),
                )
                recovery.restore_commit()
                resumed = True
                continue
            worker.report(p.Outcome.DONE)
            return result

    def _release(self, recovery: Recovery[R]) -> None:
        # Not retried: only the reset that follows moves this worker to a new round, and a
        # release that fails every time would otherwise be classified, fail, and loop.
        try:
            recovery.before_rejoin()
        except Exception as err:
            log.warning("Rank %d: releasing the interrupted attempt raised %s; re-joining anyway.",
                        self._worker.assignment.rank, _first_line(err))


def _first_line(err: BaseException) -> str:
    text = str(err)
    return p.clip(text.splitlines()[0], 200) if text else type(err).__name__
