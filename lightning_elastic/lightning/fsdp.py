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
"""

from __future__ import annotations

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
from lightning_elastic.lightning.commit import COMMIT_MARKER, CommitInfo
from lightning_elastic.lightning.environment import ElasticEnvironment, WorkerBacked, timeout_seconds
from lightning_elastic.lightning.pristine import Pristine
from lightning_elastic.lightning.sampling import ElasticSampling, call_reset_hooks
from lightning_elastic.lightning.sharded_commit import destinations, load_fit, split_fit
from lightning_elastic.membership.process_group import validate_backend, validate_timeout
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded.agreement import agree, lost_error
from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.layout import Layout, Lost, Restore, describe_coverage
from lightning_elastic.training.state import broadcast_object

log = logging.getLogger(__name__)

STRATEGY_NAME = "elastic_fsdp"
# As ModelParallelStrategy names them: configure_model reads self.device_mesh["data_parallel"].
MESH_DIMS = ("data_parallel", "tensor_parallel")


def check_parallel_sizes(data_parallel_size: Any, tensor_parallel_size: Any) -> None:
    """Data parallel over every rank of the round; no tensor parallelism."""
    if tensor_parallel_size not in ("auto", 1):
        raise ValueError(f"ElasticFSDPStrategy: tensor_parallel_size={tensor_parallel_size!r}: tensor parallelism is "
                         "not supported; expected 1 (FSDP2 over every rank of the job)")
    if data_parallel_size != "auto":
        raise ValueError(f"ElasticFSDPStrategy: data_parallel_size={data_parallel_size!r}: the data-parallel size is "
                         "the job's world size, set by lightning-elastic launch; expected it left out")


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
        check_parallel_sizes(data_parallel_size, tensor_parallel_size)
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
        if self.worker.snapshot_writer is not None or self.worker.resume_from is not None:
            raise ElasticError('strategy="elastic_fsdp" does not write durable snapshots yet; expected a launch '
                               "without --snapshot-dir")

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

    def take_commit(self, trainer: pl.Trainer) -> None:
        """Collective, at a batch end: this rank's rows and the rest into host memory, then the
        copy for its holder."""
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
        self._commit.save(entries, tensors, rest, self._layout, a.rank, worker.device, worker.wait_collective)
        worker.note_commit()

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
        pass  # refused when the launcher is built (_configure_launcher)

    def forget_commit(self) -> None:
        """Drop the commit and its buffers (a later fit of this trainer starts from its own state)."""
        self._commit = ShardedCommit()
        self._layout = self._choice = None

    def agree_on_restore(self, trainer: pl.Trainer) -> bool:
        """Collective, before every fit attempt: this round's layout and the commit to restore."""
        worker = self.worker
        a = worker.assignment
        agreed = agree(self._commit, a, worker.device, worker.wait_collective)
        if isinstance(agreed.choice, Lost):
            raise lost_error(agreed.choice)
        self._layout = agreed.layout
        self._choice = agreed.choice if isinstance(agreed.choice, Restore) else None
        self._restoring = self._choice is not None
        self._say_coverage(agreed.hosts)
        # The loggers keep the run of the member whose state is resumed (one run per job).
        source = self._choice.replicated_from if self._choice is not None else 0
        versions = [logger.version for logger in trainer.loggers] if a.rank == source else []
        for logger, version in zip(trainer.loggers, broadcast_object(versions, worker, src=source)):
            compat.set_logger_version(logger, version)
        return self._choice is not None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path != COMMIT_MARKER:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
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
        return load_fit(module, optimizers, rest, a.size)

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
        resumed_from, self._resumed_world_size = self._resumed_world_size, None
        if resumed_from is not None:
            call_reset_hooks(trainer, resumed_from, self.worker.assignment.size)
        if not self.has_commit:
            # The first commit of every round (its layout is new): a failure before the first
            # regular commit must have something to go back to.
            self.take_commit(trainer)


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
