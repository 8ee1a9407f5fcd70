"""A resumed fit's CSV logs, for both Trainer strategies (``elastic_hvd``, ``elastic_fsdp``).

A reset keeps the job's ``metrics.csv`` as its committed history: a new rank 0 goes on with
the file rather than starting it anew, and the rows of the steps the new world redoes (those
after the restored commit) are dropped, so each step is logged once and in order. The old
world's rank 0 flushes what it buffered before the reset (``fit_launcher``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_elastic.lightning import compat


class ResumedLogs:
    """Called by a strategy at three points of every fit attempt that resumes."""

    def __init__(self) -> None:
        self._log_step: int | None = None  # the restored commit's logging step, until the fit starts

    def fit_resumes(self, trainer: pl.Trainer, rank: int) -> None:
        """Once the loggers' versions are agreed, before the fit logs anything."""
        if rank == 0:
            compat.continue_csv_logs(trainer)

    def restored(self, checkpoint: dict[str, Any]) -> None:
        """The Lightning checkpoint dict of the commit (or snapshot) being restored."""
        self._log_step = compat.committed_logging_step(checkpoint)

    def train_started(self, trainer: pl.Trainer) -> None:
        step, self._log_step = self._log_step, None
        if step is not None and trainer.is_global_zero:
            compat.drop_csv_rows_after(trainer, step)  # the steps redone from here are logged again
