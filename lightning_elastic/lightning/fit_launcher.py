"""``ElasticFitLauncher``: ``trainer.fit`` that survives resets in the same process.

Lightning hands its launcher the stage function. Only ``fit`` is retried; validate, test
and predict run once, as with DDP. A fit attempt ends in one of four ways:

* it returns: the worker reports success to the driver;
* ``HostsUpdatedInterrupt`` (hosts were added or removed; raised on every rank at the same
  batch, right after a commit of the live state): re-form and resume, nothing lost;
* a lost peer (the collective failed, or the driver says a member of the round died):
  re-form and resume from the last commit;
* anything else is the user's error: reported to the driver and re-raised with its
  traceback, so Lightning's own error handling runs and the worker ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_elastic import protocol as p
from lightning_elastic.errors import HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.lightning import compat
from lightning_elastic.lightning.callbacks import ensure_elastic_callback
from lightning_elastic.lightning.commit import COMMIT_MARKER
from lightning_elastic.run import describe_error, is_collective_failure

log = logging.getLogger(__name__)

_FIT_ARGUMENTS = ("model", "train_dataloaders", "val_dataloaders", "datamodule", "ckpt_path", "weights_only")


class ElasticFitLauncher(compat.Launcher):
    def __init__(self, strategy: Any) -> None:  # an ElasticStrategy (import cycle otherwise)
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return False

    def kill(self, signum: Any) -> None:
        pass  # the workers belong to lightning-elastic launch, which stops them

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if not compat.is_fit_function(function, trainer):
            return function(*args, **kwargs)
        assert trainer is not None
        return self._fit(function, trainer, dict(zip(_FIT_ARGUMENTS, args), **kwargs))

    def _fit(self, fit_impl: Callable[..., Any], trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        strategy = self._strategy
        worker = strategy.worker
        ensure_elastic_callback(trainer)
        compat.silence_sigterm_broadcast(trainer, lambda: _exit_if_sigterm(trainer))
        user_ckpt_path = arguments.get("ckpt_path")
        while True:
            resume = strategy.agree_on_restore(trainer)
            arguments["ckpt_path"] = COMMIT_MARKER if resume else user_ckpt_path
            try:
                fit_impl(**arguments)
            except HostsUpdatedInterrupt as err:
                log.info("Rank %d: %s; re-forming with the live state.", worker.assignment.rank, err)
            except RendezvousError:
                raise  # the driver is gone or gave up on this worker
            except Exception as err:
                if not is_collective_failure(err, worker):
                    worker.report(p.Outcome.FAILED, describe_error(err))
                    raise
                log.warning(
                    "Rank %d: round %d lost a member (%s); resuming from the last commit.",
                    worker.assignment.rank, worker.assignment.round, str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
                )
            else:
                worker.report(p.Outcome.DONE)
                strategy.commit = None  # a later fit of this trainer starts from its own state
                return
            compat.prepare_to_fit_again(trainer)
            worker.reset()


def _exit_if_sigterm(trainer: pl.Trainer) -> None:
    # A SIGTERM ends this worker only; the driver sees it leave and the others re-form.
    if getattr(trainer, "received_sigterm", False):
        raise SIGTERMException()
