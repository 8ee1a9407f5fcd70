"""``ElasticFitLauncher``: ``trainer.fit`` that survives resets in the same process.

Lightning hands its launcher the stage function. Only ``fit`` is retried; validate, test
and predict run once, as with DDP. The retry cycle is the one of ``@run``
(``lightning_elastic.training.recovery``); what differs is how a new world is prepared: every fit
attempt first agrees on the newest in-memory commit and resumes from it, so a host change
(whose interrupt is raised right after a commit of the live state) loses nothing and a lost
peer goes back to the last commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_elastic.lightning import compat
from lightning_elastic.lightning.callbacks import ensure_elastic_callback
from lightning_elastic.lightning.commit import COMMIT_MARKER
from lightning_elastic.training.recovery import RetryEngine

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
        arguments = dict(zip(_FIT_ARGUMENTS, args), **kwargs)
        strategy = self._strategy
        ensure_elastic_callback(trainer)
        compat.route_sigterm(trainer, elastic=strategy.worker.handles_sigterm)
        RetryEngine(strategy.worker, _FitRecovery(strategy, trainer, function, arguments)).run()
        strategy.forget_commit()
        return None


class _FitRecovery:
    def __init__(self, strategy: Any, trainer: pl.Trainer, fit_impl: Callable[..., Any], arguments: dict[str, Any]) -> None:
        self._strategy = strategy
        self._trainer = trainer
        self._fit_impl = fit_impl
        self._arguments = arguments
        self._user_ckpt_path = arguments.get("ckpt_path")
        self._fitted = False  # has a fit attempt started (and left a trainer to tear down)?

    def before_rejoin(self) -> None:
        if self._fitted:
            compat.flush_csv_logs(self._trainer)  # the ending world's rank 0 writes its buffered rows
            compat.prepare_to_fit_again(self._trainer)

    def prepare(self, resumed: bool) -> None:
        # A durable snapshot (--snapshot-dir) becomes rank 0's commit, until an attempt
        # has started from it (the first rank 0 may be lost before anyone else has it).
        self._strategy.resume_from_snapshot()
        resume = self._strategy.agree_on_restore(self._trainer)
        self._arguments["ckpt_path"] = COMMIT_MARKER if resume else self._user_ckpt_path

    def attempt(self) -> None:
        self._fitted = True
        self._fit_impl(**self._arguments)

    def keep_live_state(self) -> None:
        pass  # ElasticCallback committed the live state before raising the interrupt

    def restore_commit(self) -> None:
        pass  # every attempt resumes from the agreed commit
