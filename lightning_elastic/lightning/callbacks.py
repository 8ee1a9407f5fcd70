"""``ElasticCallback`` (commits and host checks) and ``ScaleLearningRate`` (a reset hook).

Any callback, and the LightningModule, may define a reset hook; the strategy calls it on
every rank of the new world once the state is restored, before training resumes:

    def on_elastic_reset(self, trainer, pl_module, old_world_size, new_world_size): ...
    # LightningModule: def on_elastic_reset(self, old_world_size, new_world_size): ...

``old_world_size`` is the world size of the state being resumed (a joiner gets it too).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_elastic.errors import HostsUpdatedInterrupt
from lightning_elastic.lightning import compat

log = logging.getLogger(__name__)

# Scaled with the learning rate: param-group keys and scheduler attributes that hold one.
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LR_ATTRIBUTES = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")


class ElasticCallback(Callback):
    """Commit the training state every ``commit_every_n_steps`` training steps and check for
    host changes every ``check_every_n_steps`` (both at a batch end).

    Steps are optimizer steps counted across epochs (``trainer.global_step``), as
    ``ModelCheckpoint(every_n_train_steps=...)`` counts them: with gradient accumulation only
    the batch that steps the optimizer can commit or check, and a commit every 10 steps
    lands on steps 10, 20, 30, ... whatever the number of batches per epoch. A check that
    finds a change commits the live state first, so the new world resumes exactly where
    the old one stopped. When a trainer has several ``ElasticCallback`` instances, the first
    one of exactly this class (else the first subclass) does the committing; the others only
    receive ``on_elastic_reset``.

    ``commit_every_n_steps=None`` (the default) paces commits by their measured cost: a
    commit at the first step of every fit attempt, then as often as keeps commits to about
    ``commit_budget`` of the training time (1 %), but at least every ``max_redo_seconds``
    of training (10 s; what a lost worker can make the others redo). Each rank paces
    itself: a new world resumes from the newest commit among its ranks; with a strategy whose
    commits are collectives (``elastic_fsdp``) every interval is the largest among the ranks.
    Pass an integer for commits on a fixed grid, 1 for a commit at every step.

    Long phases between two training batches (a validation pass, ``on_train_epoch_end``)
    are checked for host changes too, at each validation batch end, at the validation's end
    and at the epoch's end, so that a joiner or a leaver is not kept waiting for a whole
    validation pass. A change found there ends the fit attempt without rollback only if
    every rank committed at the batch before the phase, so such a commit is taken at that
    batch when it costs at most ``commit_budget`` of the last such phase's duration (always
    before the first). The ranks agree (one small all-reduce as the phase starts) that each
    has that commit and, for validation, the same number of validation batches (the checks
    are collectives); otherwise a change waits for the next training batch, as before.
    """

    def __init__(
        self,
        commit_every_n_steps: int | None = None,
        check_every_n_steps: int = 1,
        *,
        commit_budget: float = 0.01,
        max_redo_seconds: float = 10.0,
        commit_every_n_batches: int | None = None,
        check_every_n_batches: int | None = None,
    ) -> None:
        commit_every_n_steps = _renamed("commit_every_n_batches", commit_every_n_batches, commit_every_n_steps)
        check_every_n_steps = _renamed("check_every_n_batches", check_every_n_batches, check_every_n_steps)
        for name, value in (("commit_every_n_steps", commit_every_n_steps),
                            ("check_every_n_steps", check_every_n_steps)):
            if value is None and name == "commit_every_n_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ElasticCallback: {name} must be a positive integer, got {value!r}")
        self.commit_every_n_steps = commit_every_n_steps
        self.check_every_n_steps = check_every_n_steps
        self._pacer = CommitPacer(commit_budget, max_redo_seconds) if commit_every_n_steps is None else None
        self.commit_budget = commit_budget
        self._last_step = 0  # the global step at the last batch end seen
        self._committed_this_batch = False  # a commit at this training batch's end
        self._last_commit_seconds: float | None = None
        self._phase_started: float | None = None  # a long phase (validation, epoch end) runs
        self._phase_seconds: float | None = None  # the last long phase's duration
        self._phase_checks = False  # host checks agreed for the running validation pass
        self._world_size_shown = False
        self._metrics_logged = False  # elastic/* sent to the loggers in this fit attempt

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            commit_every_n_steps=self.commit_every_n_steps, check_every_n_steps=self.check_every_n_steps
        )

    def _is_committer(self, trainer: pl.Trainer) -> bool:
        return _committer(trainer) is self

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed fit starts at the commit's step
        self._world_size_shown = False
        self._metrics_logged = False
        self._committed_this_batch = False
        self._phase_started = self._phase_seconds = None
        self._phase_checks = False
        if self._pacer is not None:
            self._pacer.start()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._committed_this_batch = False
        if self._phase_started is not None:
            self._phase_seconds = time.perf_counter() - self._phase_started
            self._phase_started = None
        if not self._world_size_shown and self._is_committer(trainer):
            # Shown in the progress bar (rank 0), not sent to loggers. Once per fit attempt
            # (the world size changes only between attempts, and the bar keeps the value):
            # a log call costs more than a small model's whole step.
            pl_module.log("world_size", float(trainer.world_size), prog_bar=True, logger=False, on_step=True, on_epoch=False)
            self._world_size_shown = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "take_commit") or not self._is_committer(trainer):
            return
        strategy.record_batch(batch_idx)
        last, step = self._last_step, trainer.global_step
        self._last_step = step
        if step <= last:
            # Equal: no optimizer step in this batch (accumulating), nothing to commit yet.
            # Lower: a resumed fit whose on_train_start a subclass did not pass on.
            return
        # "Crossed a multiple" rather than "is a multiple": several optimizers (manual
        # optimization) may advance the step by more than one per batch.
        committed = False
        if self._commit_due(last, step):
            self._commit(strategy, trainer)
            committed = True
        if compat.long_phase_follows(trainer):
            if not committed and self._phase_commit_worth_it(strategy):
                # So that a host change found during the phase resumes from here.
                self._commit(strategy, trainer)
                committed = True
            self._phase_started = time.perf_counter()
        self._committed_this_batch = committed
        if step // self.check_every_n_steps > last // self.check_every_n_steps:
            try:
                strategy.worker.check_host_updates()
            except HostsUpdatedInterrupt:
                if not committed:
                    strategy.take_commit(trainer)
                raise
        if not self._metrics_logged:
            self._metrics_logged = True
            _log_elastic_metrics(trainer)

    def _commit_due(self, last: int, step: int) -> bool:
        if self._pacer is not None:
            return self._pacer.due(step)
        n = self.commit_every_n_steps
        assert n is not None
        return step // n > last // n

    def _commit(self, strategy: Any, trainer: pl.Trainer) -> None:
        started = time.perf_counter()
        strategy.take_commit(trainer)
        finished = time.perf_counter()
        self._last_commit_seconds = finished - started
        if self._pacer is not None:
            self._pacer.committed(trainer.global_step, started, finished, agree=_common_decision(strategy))

    def _phase_commit_worth_it(self, strategy: Any) -> bool:
        """A commit before a long phase: at most ``commit_budget`` of the last one's time."""
        if self._phase_seconds is None or self._last_commit_seconds is None:
            return True
        worth = self._last_commit_seconds <= self.commit_budget * self._phase_seconds
        agree = _common_decision(strategy)
        return worth if agree is None else bool(agree(int(worth)))

    # ----- host checks in long phases (a validation pass, the epoch's end) -------------

    def _in_fit(self, trainer: pl.Trainer) -> bool:
        return (hasattr(trainer.strategy, "take_commit") and self._is_committer(trainer)
                and trainer.state.fn == "fit" and not trainer.sanity_checking)

    def _agree(self, trainer: pl.Trainer, val_batches: float = 0) -> bool:
        """Collective: has every rank committed at the batch before this phase, and does
        every rank run the same, finite number of validation batches?"""
        if not dist.is_available() or not dist.is_initialized():
            return False
        count = int(val_batches) if math.isfinite(val_batches) else -1
        flags = torch.tensor([count, -count, 0 if self._committed_this_batch else 1], dtype=torch.int64,
                             device=trainer.strategy.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        most, fewest, missing = (int(v) for v in flags.tolist())
        return most == -fewest and most >= 0 and missing == 0

    def _check_in_phase(self, trainer: pl.Trainer) -> None:
        # The commit of the batch before the phase is the live training state (a phase does
        # not train): the interrupt loses nothing, and every rank raises at the same call.
        trainer.strategy.worker.check_host_updates()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase_checks = False
        if self._in_fit(trainer):
            self._phase_checks = self._agree(trainer, sum(trainer.num_val_batches))

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._phase_checks:
            self._check_in_phase(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checks, self._phase_checks = self._phase_checks, False
        if checks:
            self._check_in_phase(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_fit(trainer) and self._agree(trainer):
            self._check_in_phase(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase_started = None

    def on_elastic_reset(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_world_size: int, new_world_size: int
    ) -> None:
        """Called on every rank after a reset, once the state is restored. Override to react."""


def paced_interval(commit_seconds: float, step_seconds: float, budget: float, max_redo_seconds: float) -> int:
    """Steps between two commits so that commits take about ``budget`` of the training time,
    but at most ``max_redo_seconds`` of training apart (at least one step)."""
    if step_seconds <= 0:
        return 1
    for_budget = math.ceil(commit_seconds / (budget * step_seconds) - 1e-9)  # 5.000000001 is 5
    for_redo = math.floor(max_redo_seconds / step_seconds)
    return max(1, min(for_budget, for_redo))


class CommitPacer:
    """When the next commit is due when it is paced by cost (``commit_every_n_steps=None``).

    The first commit of a fit attempt comes at its first step. After each commit, the
    steps since the previous one (timed without the commit itself) and the commit's own
    duration give the interval to the next (``paced_interval``).
    """

    def __init__(self, budget: float, max_redo_seconds: float) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"ElasticCallback: commit_budget must be in (0, 1], got {budget!r}")
        if not max_redo_seconds > 0:
            raise ValueError(f"ElasticCallback: max_redo_seconds must be positive, got {max_redo_seconds!r}")
        self.budget, self.max_redo_seconds = budget, max_redo_seconds
        self.next_step: int | None = None  # None: commit at the next step
        self.interval = 1  # steps between the last two commits' decisions
        self._last: tuple[int, float] | None = None  # (step, time) right after the last commit

    def start(self) -> None:
        """A fit attempt starts: commit at its first step, with no timing carried over."""
        self.next_step, self._last = None, None

    def due(self, step: int) -> bool:
        return self.next_step is None or step >= self.next_step

    def committed(self, step: int, started: float, finished: float,
                  agree: Callable[[int], int] | None = None) -> None:
        """``agree``: the largest interval among the ranks (when they must commit together)."""
        interval = 1
        if self._last is not None and step > self._last[0]:
            last_step, last_time = self._last
            step_seconds = (started - last_time) / (step - last_step)
            interval = paced_interval(finished - started, step_seconds, self.budget, self.max_redo_seconds)
        if agree is not None:
            interval = agree(interval)
        if interval != self.interval:
            log.debug("Commits every %d step(s) now (the last took %.2f ms)", interval, (finished - started) * 1e3)
        self.interval = interval
        self.next_step = step + interval
        self._last = (step, finished)


class ScaleLearningRate(ElasticCallback):
    """Linear scaling: every optimizer's LR = configured LR x world size / ``base_world_size``.

    ``base_world_size`` defaults to the world size at the start of ``fit``. Scaling is a
    multiplication of the current value (and of the schedulers' base values), so LR
    schedulers keep working on top of it instead of being overwritten or overwriting it.
    """

    def __init__(self, base_world_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if base_world_size is not None and (
            isinstance(base_world_size, bool) or not isinstance(base_world_size, int) or base_world_size < 1
        ):
            raise ValueError(f"ScaleLearningRate: base_world_size must be a positive integer, got {base_world_size!r}")
        self.base_world_size = base_world_size
        self._started = False  # has the start-of-fit scaling been applied (here or in a commit)?

    @property
    def state_key(self) -> str:
        return self._generate_state_key(base_world_size=self.base_world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"started": self._started}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._started = bool(state_dict.get("started", False))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._started:
            return  # resumed: the committed LRs already carry the scaling; resets rescale them
        self._started = True
        if self.base_world_size is not None and self.base_world_size != trainer.world_size:
            scale_learning_rates(trainer, trainer.world_size / self.base_world_size)

    def on_elastic_reset(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, old_world_size: int, new_world_size: int
    ) -> None:
        if old_world_size != new_world_size:
            scale_learning_rates(trainer, new_world_size / old_world_size)


def scale_learning_rates(trainer: pl.Trainer, factor: float) -> None:
    """Multiply every LR the optimizers and their schedulers hold by ``factor``."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key in _GROUP_LR_KEYS:
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        for attribute in _SCHEDULER_LR_ATTRIBUTES:
            values = getattr(scheduler, attribute, None)
            if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
                setattr(scheduler, attribute, [v * factor for v in values])


def _log_elastic_metrics(trainer: pl.Trainer) -> None:
    """``elastic/world_size``, ``elastic/resets`` and ``elastic/last_recovery_s`` (this
    process's last reset to its first step after it) to the Trainer's loggers, once per fit
    attempt, from global rank 0."""
    if not trainer.is_global_zero or not trainer.loggers:
        return
    worker = trainer.strategy.worker
    metrics = {"elastic/world_size": float(trainer.world_size), "elastic/resets": float(worker.resets)}
    if worker.last_recovery_s is not None:
        metrics["elastic/last_recovery_s"] = float(worker.last_recovery_s)
    step = compat.logging_step(trainer)  # the step this batch's own rows are logged at
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _renamed(old_name: str, old_value: int | None, value: int | None) -> int | None:
    if old_value is None:
        return value
    warnings.warn(
        f"ElasticCallback: {old_name} is deprecated, use {old_name.replace('batches', 'steps')} "
        "(it counts training steps across epochs)", DeprecationWarning, stacklevel=3,
    )
    return old_value


def _common_decision(strategy: Any) -> Callable[[int], int] | None:
    """For a strategy whose commits are collectives (``elastic_fsdp``: every rank sends its
    rows to a peer), the largest of a number among the ranks: a commit decided by one rank's
    own timings must be taken by all. None when each rank may commit on its own."""
    return strategy.largest_among_ranks if getattr(strategy, "commits_together", False) else None


def _committer(trainer: pl.Trainer) -> ElasticCallback | None:
    candidates = [cb for cb in trainer.callbacks if isinstance(cb, ElasticCallback)]
    exact = [cb for cb in candidates if type(cb) is ElasticCallback]
    return (exact or candidates or [None])[0]


def ensure_elastic_callback(trainer: pl.Trainer) -> ElasticCallback:
    """The trainer's committing ``ElasticCallback``; one with defaults is added if none."""
    committer = _committer(trainer)
    if committer is None:
        committer = ElasticCallback()
        trainer.callbacks.append(committer)
    return committer
