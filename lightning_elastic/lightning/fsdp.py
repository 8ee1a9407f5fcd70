"""``ElasticFSDPStrategy`` (``strategy="elastic_fsdp"``): Lightning's ``ModelParallelStrategy``
(FSDP2 applied in ``configure_model``) over the elastic worker's process group, re-formed
in-process.

The data-parallel degree is the job's world size: the mesh ``configure_model`` reads from
``self.device_mesh`` is ``ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1)``'s,
built anew on every round. Tensor parallelism is refused.

A commit is ``sharded.commit.ShardedCommit``'s: each rank's rows of the model and optimizer
state in host memory, copied to a peer on another host (``sharded_commit``), in two phases
that a rank lost inside the commit cannot tear. Each fit attempt (``ElasticFitLauncher``)
starts with the round agreeing on the newest commit still whole among its members. An attempt after a reset rebuilds the sharded submodules first:
FSDP2 cannot move a module to another mesh, so the LightningModule gets fresh meta-device
copies of its submodules as they were before the first ``configure_model`` (``pristine``),
the user's ``configure_model`` shards them on the new mesh, ``configure_optimizers`` builds
new optimizers, and ``load_checkpoint`` moves the commit's rows straight into the new local
shards (point to point: the whole model never exists on one rank). Lightning then restores
the loops, callbacks and schedulers from the commit's rest, as for ``elastic_hvd``.

With ``--snapshot-dir`` every rank also offers each commit's rows to the round's durable
sharded snapshot writer (``sharded_snapshot``: the ``le.ShardedState`` format, written in the
background). A fit attempt with no whole commit to restore reads a snapshot instead, at any
world size: the one the job resumes from at its start, or the newest when a rank was lost
together with the holder of its copy.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch.distributed.device_mesh import init_device_mesh

import lightning.pytorch as pl
from lightning_elastic.errors import ElasticError
from lightning_elastic.lightning import compat
from lightning_elastic.durable import files
from lightning_elastic.durable.files import Found
from lightning_elastic.durable.store import SnapshotInfo
from lightning_elastic.lightning.commit import COMMIT_MARKER, CommitInfo, resume_checkpoint
from lightning_elastic.lightning.environment import (
    ElasticEnvironment,
    WorkerBacked,
    check_parallel_sizes,
    timeout_seconds,
)
from lightning_elastic.lightning.pristine import Pristine
from lightning_elastic.lightning.resumed_logs import ResumedLogs
from lightning_elastic.lightning.sampling import ElasticSampling, call_reset_hooks
from lightning_elastic.lightning.sharded_commit import destinations, load_fit, split_fit
from lightning_elastic.lightning.sharded_snapshot import check_one_optimizer, fit_tree, read_fit
from lightning_elastic.membership.process_group import validate_backend, validate_timeout
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded.agreement import agree, lost_error
from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.layout import Fresh, Layout, Lost, Restore, describe_coverage
from lightning_elastic.sharded.round_writers import RoundWriters
from lightning_elastic.training.state import broadcast_object

log = logging.getLogger(__name__)

STRATEGY_NAME = "elastic_fsdp"
# As ModelParallelStrategy names them: configure_model reads self.device_mesh["data_parallel"].
MESH_DIMS = ("data_parallel", "tensor_parallel")


class ElasticFSDPStrategy(WorkerBacked, ElasticSampling, ModelParallelStrategy):
    """FSDP2 (``fully_shard`` in ``configure_model``) over the elastic worker's process group.

    Registered as ``Trainer(strategy="elastic_fsdp")``. ``configure_model`` applies
    ``fully_shard`` to submodules of the LightningModule (``self.model``), with
    ``mesh=self.device_mesh["data_parallel"]``; it runs again after every reset, on the new
    round's mesh, and must shard the same way every time.
    """

    strategy_name = STRATEGY_NAME
    elastic_name = STRATEGY_NAME
    commits_together = True  # a commit sends rows to a peer: every rank commits at the same step

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        worker: ElasticWorker | None = None,
    ) -> None:
        check_parallel_sizes("ElasticFSDPStrategy", data_parallel_size, tensor_parallel_size)
        # Checked here, so a bad value fails when the Trainer is built, not at the first round.
        seconds = None if timeout is None else validate_timeout(timeout_seconds(timeout, "ElasticFSDPStrategy"))
        backend = None if process_group_backend is None else validate_backend(process_group_backend)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)
        self.cluster_environment = ElasticEnvironment(self)
        self._bind_worker(worker, seconds, backend)
        compat.ignore_mid_epoch_resume_warning()
        self._init_sampling()
        self._commit = ShardedCommit()  # own rows, the rest, the copy held for a peer; kept across attempts
        self._layout: Layout | None = None  # this round's, agreed before each fit attempt
        self._choice: Restore | None = None  # the commit this attempt restores (None: a fresh start)
        self._mesh: Any = None
        self._pristine: Pristine | None = None
        self._configured_round: int | None = None  # the round whose mesh the submodules are sharded on
        # This attempt restores a commit, which gives every tensor its value: what configure_model
        # builds and Lightning materialises needs memory, not initial values (until setup ends).
        self._restoring = False
        self._weights_in_rows = False  # a commit's dump: the rows carry the weights, not Lightning's state dicts
        self._resumed_world_size: int | None = None  # set when a fit attempt restored a commit
        self._said_coverage: tuple[int, ...] | None = None
        self._logs = ResumedLogs()
        self._snapshots = RoundWriters()  # durable snapshots of the commits (--snapshot-dir)
        self._snapshot: Found | None = None  # the durable snapshot this attempt resumes from instead of a commit

    # ----- the world ------------------------------------------------------------------

    @property
    def device_mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("ElasticFSDPStrategy: the device mesh exists once the fit has joined the job "
                               "(read self.device_mesh in configure_model)")
        return self._mesh

    @property
    def process_group_backend(self) -> str:
        return self.worker.backend

    def _configure_launcher(self) -> None:
        from lightning_elastic.lightning.fit_launcher import ElasticFitLauncher

        self._launcher = ElasticFitLauncher(self)
        self._warn_ignored_settings("Trainer")  # the Trainer has set devices and num_nodes by now

    def setup_environment(self) -> None:
        # The worker formed this round's group at rendezvous: only the accelerator's device,
        # Lightning's view of the ranks and this round's mesh are set up here.
        Strategy.setup_environment(self)
        reset_seed()
        self.set_world_ranks()
        a = self.worker.assignment
        self._mesh = init_device_mesh(self.root_device.type, (a.size, 1), mesh_dim_names=MESH_DIMS)
        module = self.lightning_module
        compat.set_device_mesh(module, self._mesh)
        # configure_model follows: it must find unsharded submodules.
        if self._pristine is None or self._pristine.owner != id(module):
            self._pristine = Pristine.take(module)
        elif self._configured_round not in (None, a.round):
            self._pristine.rebuild(module)
        self._configured_round = a.round

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # What configure_model builds when a commit is restored is overwritten: on meta, it costs nothing.
        with super().tensor_init_context(empty_init=True if self._restoring else empty_init):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        if self._restoring:
            # Lightning would fill meta tensors with reset_parameters(); the commit gives every
            # parameter and buffer its value (load_checkpoint): only the memory is needed.
            self.lightning_module.to_empty(device=self.root_device)
        super().setup(trainer)
        self._restoring = False  # later tensor_init_context calls (trainer.init_module) are the user's
        if isinstance(self.lightning_module, FSDPModule):
            raise ElasticError('strategy="elastic_fsdp": configure_model applied fully_shard to the LightningModule '
                               "itself; expected it on its submodules (fully_shard(self.model, ...)), which a reset "
                               "rebuilds")

    # ----- commits --------------------------------------------------------------------

    @property
    def has_commit(self) -> bool:
        """A commit in this round's layout: the same answer on every rank."""
        return self._layout is not None and self._commit.has(self._layout)

    def take_commit(self, trainer: pl.Trainer, snapshot: bool = True) -> None:
        """Collective, at a batch end: this rank's rows and the rest into host memory, then the
        copy for its holder; then, with ``--snapshot-dir`` and ``snapshot``, the rows to this
        round's durable snapshot writer (written in the background when the step is due)."""
        worker = self.worker
        a = worker.assignment
        assert self._layout is not None, "a commit before the round agreed on its layout"
        info = CommitInfo(a.size, trainer.global_step, self.sampler_position(), compat.collect_rng_states())
        self._weights_in_rows = True
        try:
            checkpoint = compat.dump_checkpoint(trainer)
        finally:
            self._weights_in_rows = False
        entries, tensors, rest = split_fit(self.lightning_module, trainer.optimizers, checkpoint, info)
        # A snapshot still being written reads the own rows: the commit then takes a new buffer.
        self._commit.save(entries, tensors, rest, self._layout, a.rank, worker.device, worker.wait_collective,
                          keep_own=not self._snapshots.writing)
        worker.note_commit()
        if snapshot and getattr(worker.snapshot_writer, "settings", None) is not None:
            check_one_optimizer(trainer.optimizers)
            own = self._commit.own
            assert own is not None
            rows, own_rest = own.rows, own.rest
            self._snapshots.offer(worker, lambda: fit_tree(rows, own_rest),
                                  SnapshotInfo(round=a.round, step=trainer.global_step, epoch=trainer.current_epoch,
                                               world_size=a.size, sampler=_sampler_state(info), kind=files.SHARDED))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._weights_in_rows else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self._weights_in_rows else super().optimizer_state(optimizer)

    def largest_among_ranks(self, value: int) -> int:
        """Collective: the largest ``value`` of the round (a commit decision every rank takes)."""
        worker = self.worker
        tensor = torch.tensor([value], dtype=torch.int64, device=worker.device)
        worker.wait_collective(torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX,
                                                            async_op=True))
        return int(tensor.item())

    def resume_from_snapshot(self) -> None:
        pass  # agree_on_restore looks for the snapshot: the round decides between it and a commit

    def forget_commit(self) -> None:
        """Drop the commit and its buffers (a later fit of this trainer starts from its own state)."""
        self._commit = ShardedCommit()
        self._layout = self._choice = None

    def agree_on_restore(self, trainer: pl.Trainer) -> bool:
        """Collective, before every fit attempt: this round's layout and what it restores (the
        newest whole commit, else a durable snapshot, else nothing: a fresh start)."""
        worker = self.worker
        a = worker.assignment
        agreed = agree(self._commit, a, worker.device, worker.wait_collective)
        self._layout = agreed.layout
        self._choice = agreed.choice if isinstance(agreed.choice, Restore) else None
        self._snapshot = self._snapshot_to_resume(agreed.choice)
        if isinstance(agreed.choice, Lost):
            self._commit.clear()  # its pieces are no use without the rows lost with them
        self._restoring = self._choice is not None or self._snapshot is not None
        self._say_coverage(agreed.hosts)
        # The loggers keep the run of the member whose state is resumed (one run per job).
        source = self._choice.replicated_from if self._choice is not None else 0
        versions = [logger.version for logger in trainer.loggers] if a.rank == source else []
        for logger, version in zip(trainer.loggers, broadcast_object(versions, worker, src=source)):
            compat.set_logger_version(logger, version)
        if self._restoring:
            self._logs.fit_resumes(trainer, a.rank)
        return self._restoring

    def _snapshot_to_resume(self, choice: Restore | Fresh | Lost) -> Found | None:
        """Collective: the durable snapshot every rank resumes from (rank 0 looks): the one the
        job resumes from at its start, or the newest when no whole commit is left in memory."""
        worker = self.worker
        if isinstance(choice, Restore):
            return None
        settings = getattr(worker.snapshot_writer, "settings", None)
        locate: Any = None
        if isinstance(choice, Lost):
            if settings is not None:
                locate = functools.partial(files.newest_valid, settings.directory, log.warning)
        else:
            plan = worker.resume_from  # the job's first fit attempt only: cleared once training started
            locate = plan.locate if plan is not None else None
        found = locate() if locate is not None and worker.assignment.rank == 0 else None
        found = broadcast_object(found, worker, src=0) if locate is not None else None
        if isinstance(choice, Lost):
            if found is None:
                raise lost_error(choice, "no valid snapshot in --snapshot-dir" if settings is not None else None)
            if worker.assignment.rank == 0:
                log.warning("Sharded state lost from memory: %s; resuming from snapshot %s (step %d).", choice.reason,
                            files.base_name(found.path), found.manifest.step)
        return found

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path != COMMIT_MARKER:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self._snapshot is not None:
            return self._load_snapshot(self._snapshot)
        choice = self._choice
        assert choice is not None, "the commit marker without an agreed commit"
        worker = self.worker
        a = worker.assignment
        module, optimizers = self.lightning_module, self.optimizers
        rest, received = self._commit.restore(choice, a.rank, a.size, worker.device, worker.wait_collective,
                                              lambda entries, _: destinations(module, optimizers, entries))
        info: CommitInfo = rest["info"]
        self._resumed_world_size = info.world_size
        self._pending_sampler = info.sampler
        log.info("Rank %d: restored commit %d of step %d (world size %d -> %d); %.1f MB received from peers.",
                 a.rank, choice.version, info.global_step, info.world_size, a.size, received / 1e6)
        checkpoint = load_fit(module, optimizers, rest, a.size)
        self._logs.restored(checkpoint)
        return checkpoint

    def _load_snapshot(self, found: Found) -> dict[str, Any]:
        """Every rank: its rows of the durable snapshot ``found`` (written at any world size)
        into the rebuilt module and optimizer; the checkpoint dict for Lightning, as for a commit."""
        a = self.worker.assignment
        check_one_optimizer(self.optimizers)
        checkpoint, info = read_fit(found, self.lightning_module, self.optimizers[0])
        self._resumed_world_size = info.world_size
        self._pending_sampler = info.sampler
        if a.rank == 0:
            log.info("Resumed from snapshot %s: step %d, written at world size %d (now %d).",
                     files.base_name(found.path), found.manifest.step, found.manifest.world_size, a.size)
        checkpoint = resume_checkpoint(checkpoint, info, a.size)
        self._logs.restored(checkpoint)
        return checkpoint

    def _say_coverage(self, hosts: tuple[str, ...]) -> None:
        assert self._layout is not None
        said = (len(hosts), len(set(hosts)), self._layout.shift)
        if self.worker.assignment.rank == 0 and self._said_coverage != said:
            self._said_coverage = said
            log.info("%s", describe_coverage(hosts, self._layout.shift))

    # ----- hooks ----------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self.worker.resume_from = None  # every rank holds the resumed state now
        self._snapshot = None
        self._snapshots.round_started(self.worker.assignment.round, trainer.global_step)
        self._logs.train_started(trainer)
        resumed_from, self._resumed_world_size = self._resumed_world_size, None
        if resumed_from is not None:
            call_reset_hooks(trainer, resumed_from, self.worker.assignment.size)
        if not self.has_commit:
            # The first commit of every round (its layout is new): a failure before the first
            # regular commit must have something to go back to. Not a new step: not written.
            self.take_commit(trainer, snapshot=False)


def _sampler_state(info: CommitInfo) -> dict[str, int] | None:
    """The sampler position as a manifest records it (an ``ElasticSampler``'s state dict)."""
    position = info.sampler
    return None if position is None else {"epoch": position.epoch, "consumed": position.consumed}


def register() -> None:
    """Put ``"elastic_fsdp"`` in this Lightning package's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry  # noqa: PLC0415

    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(
            STRATEGY_NAME,
            ElasticFSDPStrategy,
            description="Elastic FSDP2 (configure_model): re-sharded in-process after lost workers and host "
                        "changes (lightning-elastic)",
        )


# Importing this module registers the name (see strategy.py).
register()
