"""Lightning Fabric with FSDP2: ``le.ElasticFabricFSDPStrategy(parallelize_fn=...)`` (registered
as ``Fabric(strategy="elastic_fsdp")``) and ``le.FabricShardedState``.

Fabric's ``ModelParallelStrategy(parallelize_fn=...)`` applies the user's ``parallelize_fn(model,
device_mesh)`` (``fully_shard`` on ``device_mesh["data_parallel"]``) in ``fabric.setup``. Its
elastic sibling takes the same function, with data parallel over every rank of the round
(``tensor_parallel_size`` 1: tensor parallelism is refused).

FSDP2 binds a module to the mesh it was sharded on, and a reset forms a new process group:
the model is rebuilt on every round, as ``le.ShardedState`` rebuilds it, so the state takes the
model's constructor and the optimizer's, not the objects. ``le.FabricShardedState`` is
``ShardedState`` (in-memory commits of each rank's rows with a copy on a peer, re-sharding
at a reset, durable DCP snapshots with ``--snapshot-dir``) whose sharding function is the
strategy's ``parallelize_fn`` on the round's ``(world, 1)`` mesh, plus what ``FabricState``
adds: ``state.setup()`` is ``fabric.setup`` of the round's model and optimizer, the loader's
elastic sampler is committed, and the loggers keep one version per job.

Only public Fabric APIs and hooks are used; importing this module imports ``lightning.fabric``,
not ``lightning.pytorch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_elastic.errors import ElasticError
from lightning_elastic.fabric import (
    FabricWorkerBacked,
    elastic_sampler_of,
    keep_logger_versions,
    record_batch,
)
from lightning_elastic.lightning.environment import ElasticEnvironment, check_parallel_sizes, timeout_seconds
from lightning_elastic.membership.process_group import validate_backend, validate_timeout
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded.state import ShardedState

STRATEGY_NAME = "elastic_fsdp"
# As ModelParallelStrategy names them: a parallelize_fn reads device_mesh["data_parallel"].
MESH_DIMS = ("data_parallel", "tensor_parallel")

ParallelizeFunction = Callable[[torch.nn.Module, DeviceMesh], torch.nn.Module]


def shard_whole(model: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
    """The ``parallelize_fn`` of ``Fabric(strategy="elastic_fsdp")``: the model as one FSDP2 unit
    (pass your own to shard block by block, which overlaps communication with compute)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


class ElasticFabricFSDPStrategy(FabricWorkerBacked, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 through ``parallelize_fn``) over the elastic
    worker's process group, with ``le.FabricShardedState``.

    ``parallelize_fn(model, device_mesh)`` is Fabric's: it applies ``fully_shard`` with
    ``mesh=device_mesh["data_parallel"]`` and returns the model; it runs again on every
    round's mesh and must shard the same way every time. ``snapshot_dir``,
    ``snapshot_every``, ``snapshot_keep`` and ``resume`` are ``le.init``'s.
    """

    elastic_name = STRATEGY_NAME

    def __init__(
        self,
        parallelize_fn: ParallelizeFunction = shard_whole,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        worker: ElasticWorker | None = None,
        snapshot_dir: Any = None,
        snapshot_every: float | None = None,
        snapshot_keep: int | None = None,
        resume: bool | None = None,
    ) -> None:
        check_parallel_sizes("ElasticFabricFSDPStrategy", data_parallel_size, tensor_parallel_size)
        if not callable(parallelize_fn):
            raise TypeError("ElasticFabricFSDPStrategy: parallelize_fn must be a function (model, device_mesh) -> "
                            f"model, got {type(parallelize_fn).__name__}")
        # Checked here, so a bad value fails when the Fabric is built, not at the first round.
        seconds = None if timeout is None else validate_timeout(timeout_seconds(timeout, "ElasticFabricFSDPStrategy"))
        backend = None if process_group_backend is None else validate_backend(process_group_backend)
        super().__init__(parallelize_fn, data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)
        self.cluster_environment = ElasticEnvironment(self)
        self._shard_fn = parallelize_fn
        self._round_mesh: tuple[int, DeviceMesh] | None = None  # (round, its mesh)
        self._bind_worker(worker, seconds, backend, {
            "directory": snapshot_dir, "every": snapshot_every, "keep": snapshot_keep, "resume": resume})

    @property
    def device_mesh(self) -> DeviceMesh:
        """This round's ``(world, 1)`` mesh (``"data_parallel"``, ``"tensor_parallel"``)."""
        round_ = self.worker.assignment.round
        if self._round_mesh is None or self._round_mesh[0] != round_:
            a = self.worker.assignment
            self._round_mesh = (round_, init_device_mesh(self.root_device.type, (a.size, 1), mesh_dim_names=MESH_DIMS))
        return self._round_mesh[1]

    @property
    def process_group_backend(self) -> str:
        return self.worker.backend

    def setup_environment(self) -> None:
        # The worker formed this round's group at rendezvous; the mesh is made per round (device_mesh).
        ParallelStrategy.setup_environment(self)
        self._join()

    def parallelize(self, model: torch.nn.Module, _mesh: Any = None) -> None:
        """Shard ``model`` with ``parallelize_fn`` on this round's mesh (the state's sharding
        function: it builds the model on every round)."""
        returned = self._shard_fn(model, self.device_mesh)
        if returned is not model:
            raise ElasticError("ElasticFabricFSDPStrategy: parallelize_fn returned "
                               f"{type(returned).__name__ if returned is not None else 'None'}; expected the model it "
                               "was given, sharded in place by fully_shard (return model)")

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # The state built and sharded it on this round's mesh already (parallelize).
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            raise ElasticError(f'strategy="{STRATEGY_NAME}": the model is built and sharded by le.FabricShardedState '
                               "on every round; expected model, optimizer = state.setup() instead of "
                               "fabric.setup(model)")
        return module


class FabricShardedState(ShardedState):
    """``le.FabricShardedState(fabric, model=Model, optimizer=lambda p: AdamW(p), loader=l, epoch=0)``.

    ``ShardedState`` for a Fabric loop with ``le.ElasticFabricFSDPStrategy``:

    * ``model()`` builds the module (its constructor) and ``optimizer(params)`` the optimizer;
      the strategy's ``parallelize_fn`` shards the module between the two, on every round;
    * ``init_weights(model)`` (optional): build on the meta device and fill the local shards
      at the first start (a model too large to build whole); without it every rank builds
      ``model()`` with the same seed;
    * ``scheduler(optimizer)`` (optional): builds an LR scheduler;
    * ``loader``: the training loader ``fabric.setup_dataloaders`` returned, whose elastic
      sampler's position is committed with the rest;
    * other keyword arguments: plain values (``state.epoch += 1``), the same on every rank.

    In ``@le.run``: ``model, optimizer = state.setup()`` at the start of every attempt,
    ``state.sampler.set_epoch(state.epoch)`` at the start of every epoch,
    ``state.record_batch(batch_idx)`` after every step, and ``state.commit()`` every few steps.
    """

    def __init__(self, fabric: Fabric, model: Callable[[], torch.nn.Module],
                 optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer], *,
                 loader: Any = None, init_weights: Callable[[torch.nn.Module], None] | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, **values: Any) -> None:
        strategy = fabric.strategy
        if not isinstance(strategy, ElasticFabricFSDPStrategy):
            raise ValueError(f"FabricShardedState: the Fabric's strategy must be {STRATEGY_NAME!r} "
                             f"(le.ElasticFabricFSDPStrategy), got {type(strategy).__name__}")
        sampler = elastic_sampler_of(loader, "FabricShardedState", STRATEGY_NAME)
        extra = {"sampler": sampler} if sampler is not None else {}
        super().__init__(model, strategy.parallelize, optimizer, init_weights=init_weights, scheduler=scheduler,
                         worker=strategy.worker, **extra, **values)
        object.__setattr__(self, "_fabric", fabric)
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_logger_versions", None)  # as rank 0 of a round set them

    @property
    def fabric(self) -> Fabric:
        return self._fabric

    @property
    def loader(self) -> Any:
        return self._loader

    def setup(self) -> tuple[Any, Any]:
        """``fabric.setup(model, optimizer)`` of this round's model and optimizer (Fabric's
        wrappers: ``fabric.backward`` and the precision plugin apply)."""
        strategy = self._fabric.strategy
        assert isinstance(strategy, ElasticFabricFSDPStrategy)
        strategy.refresh_ranks()
        versions = keep_logger_versions(self._fabric, self.worker, self._logger_versions)
        object.__setattr__(self, "_logger_versions", versions)
        return self._fabric.setup(self.model, self.optimizer)

    def record_batch(self, batch_idx: int) -> None:
        """Count batch ``batch_idx`` of this pass over the loader as processed by every rank."""
        record_batch(getattr(self, "sampler", None), batch_idx, "FabricShardedState")


def register_fabric_strategy() -> None:
    """Put ``"elastic_fsdp"`` in Fabric's strategy registry (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: PLC0415

    if STRATEGY_NAME not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register(
            STRATEGY_NAME, ElasticFabricFSDPStrategy,
            description="Elastic FSDP2 for Fabric: re-sharded in-process after lost workers and host changes "
                        "(lightning-elastic)",
        )


# Importing this module registers the name; see the end of lightning_elastic.fabric.
register_fabric_strategy()
