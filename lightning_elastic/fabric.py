"""Lightning Fabric: ``Fabric(strategy="elastic_hvd")`` and ``le.FabricState``.

A Fabric loop is a hand-written loop, so it is made elastic the way a plain one is: inside
``@le.run``, with a state that commits, restores and syncs. What Fabric adds is handled
here:

- ``ElasticFabricStrategy`` (registered as ``"elastic_hvd"`` in Fabric's strategy registry)
  is Fabric's DDP over the elastic worker's process group: ``fabric.launch()`` joins the
  job instead of starting processes (``lightning-elastic launch`` started them), and rank
  and world size follow the worker from round to round.
- ``fabric.setup_dataloaders`` gets the elastic sampler (each sample once per epoch in the
  committed history, across resets) instead of torch's ``DistributedSampler``; with
  ``use_distributed_sampler=False`` the loader is left as given, whole on every rank, as
  with Fabric's ddp.
- ``le.FabricState(fabric, model=..., optimizer=..., loader=..., epoch=0)`` commits what
  ``fabric.save`` would save of them (the unwrapped model's and optimizer's state dicts, the
  plain values) plus the sampler's position; ``state.setup()`` runs ``fabric.setup`` on the
  current round's group, and is called again in every attempt (a torch DDP is bound to the
  group it was built on).

- A script without ``@le.run`` gets its end reported at exit (``report_end_outside_retry_loop``),
  and Fabric's loggers keep one version per job (``FabricState.setup``).

``FabricWorkerBacked`` is what this strategy shares with its FSDP2 sibling,
``Fabric(strategy="elastic_fsdp")`` (``lightning_elastic.fabric_fsdp``).

Only public Fabric APIs are used, except pinning a logger's version, which goes through
``lightning_elastic.lightning.compat`` and is imported only by a Fabric with loggers;
importing this module imports ``lightning.fabric``, not ``lightning.pytorch``.
"""

from __future__ import annotations

import atexit
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_elastic import protocol as p
from lightning_elastic.lightning.environment import ElasticEnvironment, WorkerBacked
from lightning_elastic.membership.process_group import validate_backend, validate_timeout
from lightning_elastic.training.recovery import describe_error
from lightning_elastic.training.sampler import ElasticSampler
from lightning_elastic.training.state import TorchState, broadcast_object
from lightning_elastic.membership.worker import ElasticWorker

STRATEGY_NAME = "elastic_hvd"


class FabricWorkerBacked(WorkerBacked):
    """What both Fabric strategies (``elastic_hvd``, ``elastic_fsdp``) do alike: join the job
    instead of starting processes, follow the worker's ranks from round to round, and give
    ``fabric.setup_dataloaders`` the elastic sampler. Mixed in before Lightning's class."""

    world_size: int
    global_rank: int

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Fabric reads these only for setup_dataloaders(use_distributed_sampler=True) (its
        # default) and puts a DistributedSampler made with them on the loader, which
        # process_dataloader then replaces with the elastic sampler. The world size is marked
        # so that it tells Fabric's sampler from one the user made; a loader set up with
        # use_distributed_sampler=False keeps its own sampler, whole on every rank, as with ddp.
        return {"num_replicas": _ElasticShare(self.world_size), "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = None  # the processes exist already: lightning-elastic launch started them
        self._warn_ignored_settings("Fabric")  # Fabric has set devices and num_nodes by now

    def _join(self) -> None:
        """Fabric's setup_environment: the worker forms each round's group at its
        rendezvous; Fabric only reads the ranks."""
        self.refresh_ranks()
        if self.worker.elastic:
            atexit.register(report_end_outside_retry_loop, self.worker)

    def _get_process_group_backend(self) -> str:
        return self.worker.backend

    def refresh_ranks(self) -> None:
        """After a reset: rank-zero-only logging follows the new rank."""
        rank_zero_only.rank = self.global_rank

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        sampler = dataloader.sampler
        if not isinstance(sampler, DistributedSampler):
            return dataloader  # use_distributed_sampler=False, or an iterable dataset: as given, as with ddp
        if isinstance(sampler.num_replicas, _ElasticShare) and _replaceable(dataloader):
            elastic = ElasticSampler(dataloader.dataset, shuffle=sampler.shuffle, seed=sampler.seed,
                                     worker=self.worker, batch_size=dataloader.batch_size)
            return _with_sampler(dataloader, _FabricSampler(elastic))
        warnings.warn(
            "lightning-elastic: this DataLoader has a custom sampler, batch sampler or class; its samples are "
            "split among the ranks of the current round only, so they may be repeated or skipped after a reset "
            "(use a plain DataLoader with batch_size and shuffle for exactly-once epochs, or "
            "setup_dataloaders(..., use_distributed_sampler=False) for a loader every rank reads whole).",
            stacklevel=2,
        )
        return dataloader


class ElasticFabricStrategy(FabricWorkerBacked, DDPStrategy):
    """Fabric's DDP over the elastic worker's process group (NCCL on ``cuda:LOCAL_RANK``, else gloo).

    ``snapshot_dir``, ``snapshot_every``, ``snapshot_keep`` and ``resume`` are ``le.init``'s
    (durable snapshots of a ``FabricState``, for a job started otherwise than by the
    launcher's ``--snapshot-dir``).
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        worker: ElasticWorker | None = None,
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        snapshot_dir: Any = None,
        snapshot_every: float | None = None,
        snapshot_keep: int | None = None,
        resume: bool | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"ElasticFabricStrategy: timeout must be a datetime.timedelta, got {timeout!r}")
        collective_timeout = None if timeout is None else validate_timeout(timeout.total_seconds())
        backend = None if process_group_backend is None else validate_backend(process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=ElasticEnvironment(self),
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            **({"timeout": timeout} if timeout is not None else {}),
            **ddp_kwargs,
        )
        self._bind_worker(worker, collective_timeout, backend, {
            "directory": snapshot_dir, "every": snapshot_every, "keep": snapshot_keep, "resume": resume})

    def _setup_distributed(self) -> None:
        self._process_group_backend = self.worker.backend
        self._join()


def report_end_outside_retry_loop(worker: ElasticWorker) -> None:
    """At the exit of a process whose training ran outside ``@le.run`` (a Fabric script that
    does not import lightning_elastic, say), tell the driver how it ended, as ``@le.run``
    would: training returned (a clean exit), or failed with the uncaught error. Without this
    the driver takes a clean exit for a failure. Nothing recovers such a script: an error or
    a lost worker ends its training, which the line printed then says.
    """
    if worker.reported is not None or worker.in_retry_loop:
        return  # @le.run reported (or will report) itself
    error = getattr(sys, "last_value", None)  # the uncaught exception whose traceback was printed
    if error is None:
        worker.report(p.Outcome.DONE)
        return
    print("lightning-elastic: this process raised outside @le.run, where nothing recovers; a Fabric loop "
          "survives errors and lost workers inside @le.run with le.FabricState (README: Quickstart: Lightning "
          "Fabric)", file=sys.stderr, flush=True)
    worker.report(p.Outcome.FAILED, describe_error(error))


class _ElasticShare(int):
    """The world size in the ``DistributedSampler`` Fabric makes for this strategy: its mark."""


class _FabricSampler(Sampler[int]):
    """The elastic sampler as a Fabric loader holds it.

    Fabric's loader wrapper sets the epoch of its sampler to the number of times it was
    iterated. For a loader in a ``FabricState`` (``owned``) that count is ignored: after a
    reset it is not the epoch, which is committed state, set by the loop. Any other loader
    (an evaluation loader, a script without ``@le.run``) takes it, as with ddp: without it,
    every epoch would have the same order.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.elastic = sampler
        self.owned = False

    def set_epoch(self, epoch: int) -> None:
        if not self.owned:
            self.elastic.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.elastic)

    def __len__(self) -> int:
        return len(self.elastic)


def _replaceable(dataloader: DataLoader) -> bool:
    """A plain DataLoader, on a map-style dataset, with a Random or Sequential sampler (which
    Fabric replaced with its ``DistributedSampler``): the elastic sampler stands in for it."""
    return (type(dataloader) is DataLoader and type(dataloader.sampler) is DistributedSampler
            and dataloader.batch_size is not None and not isinstance(dataloader.dataset, IterableDataset))


def _with_sampler(loader: DataLoader, sampler: Sampler[int]) -> DataLoader:
    """The same DataLoader (its public arguments) with ``sampler``."""
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
    )


class FabricState(TorchState):
    """``TorchState`` for a Fabric loop: ``le.FabricState(fabric, model=m, optimizer=o, loader=l, epoch=0)``.

    ``model`` and ``optimizer`` are the unwrapped objects (what ``fabric.save`` saves of
    them); ``loader`` is the training loader ``fabric.setup_dataloaders`` returned, whose
    elastic sampler's position is committed with the rest. In ``@le.run``:
    ``model, optimizer = state.setup()`` at the start of every attempt,
    ``state.sampler.set_epoch(state.epoch)`` at the start of every epoch, and
    ``state.record_batch(batch_idx)`` after every step.
    """

    _snapshot_kind = "fabric"  # a durable snapshot loads with fabric.load(path, {"model": ..., ...})

    def __init__(self, fabric: Fabric, model: Any = None, optimizer: Any = None, loader: Any = None,
                 **values: Any) -> None:
        strategy = fabric.strategy
        if not isinstance(strategy, ElasticFabricStrategy):
            raise ValueError(f"FabricState: the Fabric's strategy must be {STRATEGY_NAME!r}, got "
                             f"{type(strategy).__name__}")
        sampler = elastic_sampler_of(loader, "FabricState", STRATEGY_NAME)
        extra = {"sampler": sampler} if sampler is not None else {}
        super().__init__(model, optimizer, worker=strategy.worker, **extra, **values)
        object.__setattr__(self, "_fabric", fabric)
        object.__setattr__(self, "_loader", loader)
        # The versions (runs) of the Fabric's loggers, as rank 0 of a round set them.
        object.__setattr__(self, "_logger_versions", None)

    @property
    def fabric(self) -> Fabric:
        return self._fabric

    @property
    def loader(self) -> Any:
        return self._loader

    def setup(self) -> Any:
        """``fabric.setup(model, optimizer)`` on the current round's process group."""
        strategy = self._fabric.strategy
        assert isinstance(strategy, ElasticFabricStrategy)
        strategy.refresh_ranks()
        self._keep_logger_versions()
        objects = [obj for obj in (getattr(self, "model", None), getattr(self, "optimizer", None)) if obj is not None]
        return self._fabric.setup(*objects)

    def _keep_logger_versions(self) -> None:
        versions = keep_logger_versions(self._fabric, self.worker, self._logger_versions)
        object.__setattr__(self, "_logger_versions", versions)

    def record_batch(self, batch_idx: int) -> None:
        """Count batch ``batch_idx`` of this pass over the loader as processed by every rank."""
        record_batch(getattr(self, "sampler", None), batch_idx, type(self).__name__)


def keep_logger_versions(fabric: Fabric, worker: ElasticWorker, versions: list[Any] | None) -> list[Any] | None:
    """One logger version (run) per job, as the Trainer integration keeps: a new rank 0
    would otherwise pick the next version and go on logging in a new folder. Rank 0
    shares the versions it logs to (``versions``, which a survivor of an earlier round has
    from it), and every rank pins them, ready to log should it become rank 0. Returns the
    versions to keep for the next round."""
    loggers = fabric.loggers
    if not loggers:
        return versions
    # The private part (a logger's version is set only at construction) is in compat;
    # importing it loads lightning.pytorch, paid only by a Fabric with loggers.
    from lightning_elastic.lightning.compat import set_logger_version  # noqa: PLC0415

    if worker.assignment.rank == 0 and versions is None:
        versions = [logger.version for logger in loggers]
    versions = broadcast_object(versions, worker, src=0)
    for logger, version in zip(loggers, versions or ()):
        set_logger_version(logger, version)
    return versions


def record_batch(sampler: ElasticSampler | None, batch_idx: int, owner: str) -> None:
    """Count batch ``batch_idx`` of this pass over the state's loader as processed by every rank."""
    if sampler is None or sampler.batch_size is None:
        raise RuntimeError(f"{owner}.record_batch: no elastic loader was given (loader=...)")
    sampler.record_batch(batch_idx, sampler.batch_size)


def elastic_sampler_of(loader: Any, owner: str, strategy_name: str) -> ElasticSampler | None:
    """The elastic sampler of ``loader`` (None without a loader), now owned by a state."""
    if loader is None:
        return None
    sampler = _elastic_sampler_of(loader)
    if sampler is None:
        raise ValueError(f"{owner}: loader must come from fabric.setup_dataloaders with the "
                         f"{strategy_name!r} strategy and a plain DataLoader (its sampler is not elastic)")
    return sampler


def _elastic_sampler_of(loader: Any) -> ElasticSampler | None:
    """The loader's elastic sampler, now owned by a state (its epoch is the state's)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, _FabricSampler):
        return None
    sampler.owned = True
    return sampler.elastic


def register_fabric_strategy() -> None:
    """Put ``"elastic_hvd"`` in Fabric's strategy registry (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: PLC0415

    if STRATEGY_NAME not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register(
            STRATEGY_NAME, ElasticFabricStrategy,
            description="Elastic DDP for Fabric: survives lost workers and host changes in-process (lightning-elastic)",
        )


# Importing this module registers the name. The import hook that brings it in when
# ``lightning.fabric`` is imported may run while this module is itself importing
# ``lightning.fabric`` (half initialised); the registration then happens here, at its end.
register_fabric_strategy()
