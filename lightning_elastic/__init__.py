"""lightning-elastic: elastic, fault-tolerant training for PyTorch Lightning and plain PyTorch.

Worker side. ``import lightning_elastic as le``; ``le.init()``; wrap the training function
in ``@le.run`` with a ``le.TorchState``; ``state.commit()`` every few batches.

Lightning users write ``Trainer(strategy="elastic_hvd")`` (or ``"elastic_fsdp"`` for FSDP2 in
``configure_model``; Fabric the same names, with ``le.FabricState`` / ``le.FabricShardedState``): importing this package registers the names as soon as
``lightning.pytorch`` is imported (before or after this package), and
``le.ElasticStrategy``, ``le.ElasticFSDPStrategy``, ``le.ElasticCallback`` and
``le.ScaleLearningRate`` load the Lightning integration on first use. A plain-PyTorch worker never imports Lightning.

Driver side: ``lightning_elastic.launcher`` (the ``launcher/`` folder of the repository),
which shares only ``lightning_elastic.protocol`` with the worker side.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_elastic._version import __version__
from lightning_elastic.import_hook import call_after_import

# Every public name loads on first use (PEP 562): the driver and the ssh supervisor import
# ``lightning_elastic.launcher`` and ``lightning_elastic.protocol``, which must not pay for
# torch. ``import lightning_elastic`` alone imports neither torch nor Lightning.
_EXPORTS = {
    "lightning_elastic.api": ("cross_rank", "cross_size", "current_worker", "init", "local_rank",
                              "load_snapshot", "local_size", "rank", "size", "slot_info"),
    "lightning_elastic.training.ddp": ("DistributedDataParallel",),
    "lightning_elastic.errors": ("CollectiveError", "ElasticError", "HostsUpdatedInterrupt", "RendezvousError"),
    "lightning_elastic.training.runner": ("run",),
    "lightning_elastic.training.sampler": ("ElasticSampler",),
    "lightning_elastic.training.state": ("ObjectState", "State", "TorchState"),
    "lightning_elastic.sharded.state": ("ShardedState",),
    "lightning_elastic.membership.worker": ("ElasticWorker", "SlotInfo"),
    "lightning_elastic.lightning": ("ElasticCallback", "ElasticFSDPStrategy", "ElasticStrategy", "ScaleLearningRate"),
    "lightning_elastic.fabric": ("ElasticFabricStrategy", "FabricState"),
    "lightning_elastic.fabric_fsdp": ("ElasticFabricFSDPStrategy", "FabricShardedState"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from lightning_elastic.api import (
        cross_rank,
        cross_size,
        current_worker,
        init,
        load_snapshot,
        local_rank,
        local_size,
        rank,
        size,
        slot_info,
    )
    from lightning_elastic.errors import CollectiveError, ElasticError, HostsUpdatedInterrupt, RendezvousError
    from lightning_elastic.fabric import ElasticFabricStrategy, FabricState
    from lightning_elastic.fabric_fsdp import ElasticFabricFSDPStrategy, FabricShardedState
    from lightning_elastic.lightning import ElasticCallback, ElasticFSDPStrategy, ElasticStrategy, ScaleLearningRate
    from lightning_elastic.membership.worker import ElasticWorker, SlotInfo
    from lightning_elastic.training.ddp import DistributedDataParallel
    from lightning_elastic.training.runner import run
    from lightning_elastic.training.sampler import ElasticSampler
    from lightning_elastic.sharded.state import ShardedState
    from lightning_elastic.training.state import ObjectState, State, TorchState


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


def _register_with(module: ModuleType) -> None:
    from lightning_elastic.lightning.registration import register_strategy

    register_strategy(module.__name__)


def _register_with_fabric(_module: ModuleType) -> None:
    importlib.import_module("lightning_elastic.fabric")  # registers "elastic_hvd" on import
    importlib.import_module("lightning_elastic.fabric_fsdp")  # registers "elastic_fsdp" on import


call_after_import("lightning.pytorch", _register_with)
call_after_import("pytorch_lightning", _register_with)
call_after_import("lightning.fabric", _register_with_fabric)

__all__ = [
    "CollectiveError",
    "DistributedDataParallel",
    "ElasticCallback",
    "ElasticFSDPStrategy",
    "ElasticStrategy",
    "ScaleLearningRate",
    "ElasticError",
    "ElasticFabricFSDPStrategy",
    "ElasticFabricStrategy",
    "ElasticSampler",
    "ElasticWorker",
    "FabricShardedState",
    "FabricState",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "RendezvousError",
    "ShardedState",
    "SlotInfo",
    "State",
    "TorchState",
    "cross_rank",
    "cross_size",
    "current_worker",
    "init",
    "load_snapshot",
    "local_rank",
    "local_size",
    "rank",
    "run",
    "size",
    "slot_info",
]
