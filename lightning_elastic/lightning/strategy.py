"""``ElasticStrategy`` (``strategy="elastic_hvd"``): DDP whose world is re-formed in-process.

Rank and world size come from the driver's rendezvous and change at every reset. The
process group belongs to the worker (``lightning_elastic.membership.worker``), not to Lightning: the
strategy never calls ``init_process_group``. ``ElasticFitLauncher`` runs ``fit`` again in
the same process after a reset; this class supplies what that needs: the in-memory commit,
a checkpoint path that means "the agreed commit", the elastic training sampler and the
reset hooks.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy

import lightning.pytorch as pl
from lightning_elastic.commit import init_sync
from lightning_elastic.lightning import compat
from lightning_elastic.lightning.commit import (
    COMMIT_MARKER,
    METRICS_KEY,
    RestorePlan,
    agree_on_restore,
    checkpoint_for_lightning,
    commit_info,
    load_snapshot_commit,
    snapshot_info,
    receive_commit,
    take_split_commit,
)
from lightning_elastic.lightning.capture import CheckpointCapture
from lightning_elastic.lightning.environment import ElasticEnvironment, WorkerBacked, timeout_seconds
from lightning_elastic.lightning.resumed_logs import ResumedLogs
from lightning_elastic.lightning.sampling import ElasticSampling, call_reset_hooks
from lightning_elastic.membership.process_group import validate_backend, validate_timeout
from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.membership.worker import ElasticWorker

log = logging.getLogger(__name__)

STRATEGY_NAME = "elastic_hvd"


class ElasticStrategy(WorkerBacked, ElasticSampling, DDPStrategy):
    """DDP over the elastic worker's process group (NCCL on ``cuda:LOCAL_RANK``, else gloo).

    Registered as ``Trainer(strategy="elastic_hvd")``: elastic training with Elastic
    Horovod's semantics, named as Lightning names its strategies; no Horovod is involved.
    ``snapshot_dir``, ``snapshot_every``, ``snapshot_keep`` and ``resume`` are
    ``le.init``'s (durable snapshots, for a job started otherwise than by the launcher's
    ``--snapshot-dir``): each snapshot is a Lightning checkpoint.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        worker: ElasticWorker | None = None,
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        snapshot_dir: Any = None,
        snapshot_every: float | None = None,
        snapshot_keep: int | None = None,
        resume: bool | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        # Checked here, so a bad value fails when the Trainer is built, not at the first round.
        collective_timeout = None if timeout is None else validate_timeout(timeout_seconds(timeout, "ElasticStrategy"))
        backend = None if process_group_backend is None else validate_backend(process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=ElasticEnvironment(self),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            start_method="popen",
            **({"timeout": timeout} if timeout is not None else {}),
            process_group_backend=process_group_backend,
            **ddp_kwargs,
        )
        self._bind_worker(worker, collective_timeout, backend, {
            "directory": snapshot_dir, "every": snapshot_every, "keep": snapshot_keep, "resume": resume})
        compat.ignore_mid_epoch_resume_warning()
        self.snapshot = HostSnapshot()  # the in-memory commit, kept across fit attempts
        self._capture = CheckpointCapture()
        self._restore: RestorePlan | None = None
        self._resumed_world_size: int | None = None  # set when a fit resumed from a commit
        self._init_sampling()
        self._pending_metrics: dict[str, float] | None = None  # the commit's, set at train start
        self._logs = ResumedLogs()
        # This fit attempt is loading the agreed commit / has loaded its weights into the
        # LightningModule on every rank (strictly): DDP need not broadcast them again.
        self._loading_commit = False
        self._weights_synced = False

    # ----- the world ------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        from lightning_elastic.lightning.fit_launcher import ElasticFitLauncher

        self._launcher = ElasticFitLauncher(self)
        self._warn_ignored_settings("Trainer")  # the Trainer has set devices and num_nodes by now

    def setup_distributed(self) -> None:
        # The worker formed this round's group at rendezvous; only Lightning's view is updated.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self.worker.backend

    def _get_process_group_backend(self) -> str:
        return self.worker.backend

    # ----- commits --------------------------------------------------------------------

    def take_commit(self, trainer: pl.Trainer) -> None:
        """Copy the full training state into host memory (called at a batch end)."""
        position = self.sampler_position()
        skeleton, sources = self._capture.capture(trainer)
        skeleton = {**skeleton, METRICS_KEY: compat.computed_callback_metrics(trainer)}
        take_split_commit(self.snapshot, skeleton, sources, self.worker.assignment.size, trainer.global_step, position)
        self.worker.note_commit()
        writer = self.worker.snapshot_writer
        if writer is not None:
            a = self.worker.assignment
            writer.offer(self.snapshot, snapshot_info(self.snapshot, a.round, trainer.current_epoch),
                         may_start=a.rank == 0)

    def resume_from_snapshot(self) -> None:
        """Before the first fit attempt: rank 0 takes the durable snapshot this job resumes
        from (``--snapshot-dir``) as its commit, which every rank then agrees on and loads."""
        worker = self.worker
        plan = worker.resume_from  # cleared once a fit attempt starts training from it
        if plan is None or worker.assignment.rank != 0:
            return
        found = plan.locate()
        if found is not None:
            load_snapshot_commit(self.snapshot, found.path)
            log.info("Resuming from snapshot %s: step %d, epoch %d, written at world size %d (now %d).",
                     found.path, found.manifest.step, found.manifest.epoch, found.manifest.world_size,
                     worker.assignment.size)

    @property
    def has_commit(self) -> bool:
        return commit_info(self.snapshot) is not None

    def forget_commit(self) -> None:
        """Drop the commit and its buffers (a later fit of this trainer starts from its own state)."""
        self.snapshot.clear()

    def agree_on_restore(self, trainer: pl.Trainer) -> bool:
        """Collective, before every fit attempt: is there a commit to resume from?"""
        self._loading_commit = self._weights_synced = False  # a new attempt: nothing loaded yet
        candidate = self._is_source_candidate()
        versions = [logger.version for logger in trainer.loggers] if candidate else []
        callbacks = compat.callbacks_deciding_state(trainer) if candidate else {}
        self._restore = agree_on_restore(self.worker, self.snapshot, versions, callbacks)
        for logger, version in zip(trainer.loggers, self._restore.logger_versions):
            compat.set_logger_version(logger, version)
        # Before the attempt's first hook: a joiner, and a survivor after a rollback, enter the
        # collectives of Lightning's callbacks exactly when the source does (issue 37, point 1).
        compat.restore_callbacks_deciding_state(trainer, self._restore.callbacks_state)
        resuming = self._restore.source_rank is not None
        if resuming:
            self._logs.fit_resumes(trainer, self.worker.assignment.rank)
        return resuming

    def _is_source_candidate(self) -> bool:
        # Only a rank that could be the source asks its loggers for a version: a version
        # asked of a logger that never logged would be a new one.
        return self.has_commit or self.worker.assignment.rank == 0

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path != COMMIT_MARKER:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self._restore is not None and self._restore.source_rank is not None
        committed = receive_commit(self.worker, self.snapshot, self._restore.source_rank)
        self._logs.restored(committed.skeleton)
        self._loading_commit = True
        self._resumed_world_size = committed.meta.world_size
        self._pending_sampler = committed.meta.sampler
        checkpoint = checkpoint_for_lightning(committed, self.worker.assignment.size)
        self._pending_metrics = checkpoint.pop(METRICS_KEY, None)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        # Every rank loaded the same commit; strictly: no parameter was left as it was.
        self._weights_synced = self._loading_commit and strict
        self._loading_commit = False

    def configure_ddp(self) -> None:
        # After a reset every rank holds the agreed commit's weights: torch's DDP is built
        # without its initial broadcast of them (lightning_elastic.commit.init_sync decides, with
        # every rank; never on a first fit, whose ranks may hold different initial weights).
        synced, self._weights_synced = self._weights_synced, False
        a = self.worker.assignment
        kwargs = init_sync.ddp_kwargs_for(self.model, compat.ddp_kwargs(self), synced, a.size,
                                          init_sync.group_gather(self.worker.device, self.worker.wait_collective))
        with compat.ddp_kwargs_replaced(self, kwargs):
            super().configure_ddp()

    # ----- hooks ----------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        self.worker.resume_from = None  # every rank holds the resumed state now
        self._capture.new_attempt()
        trainer = self.lightning_module.trainer
        metrics, self._pending_metrics = self._pending_metrics, None
        if metrics is not None:
            compat.restore_callback_metrics(trainer, metrics)
            compat.step_plateau_schedulers_at_epoch_end(trainer)
        self._logs.train_started(trainer)
        resumed_from, self._resumed_world_size = self._resumed_world_size, None
        if resumed_from is not None:
            call_reset_hooks(trainer, resumed_from, self.worker.assignment.size)
        if not self.has_commit:
            # A failure before the first regular commit must have something to go back to.
            self.take_commit(trainer)


def register() -> None:
    """Put ``"elastic_hvd"`` in this Lightning package's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry  # noqa: PLC0415

    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(
            STRATEGY_NAME,
            ElasticStrategy,
            description="Elastic DDP: survives lost workers and host changes in-process (lightning-elastic)",
        )


# Importing this module registers the name: the import hook that registers it may have run
# while this module was importing Lightning, half initialised (see registration.py).
register()
