"""lightning-elastic: elastic, fault-tolerant training for PyTorch Lightning and plain PyTorch.

Worker side. ``import lightning_elastic as le``; ``le.init()``; wrap the training function
in ``@le.run`` with a ``le.TorchState``; ``state.commit()`` every few batches.

Lightning users write ``Trainer(strategy="elastic_hvd")``: importing this package registers
the name as soon as ``lightning.pytorch`` is imported (before or after this package), and
``le.ElasticStrategy``, ``le.ElasticCallback`` and ``le.ScaleLearningRate`` load the
Lightning integration on first use. A plain-PyTorch worker never imports Lightning.
"""

from types import ModuleType
from typing import Any

from lightning_elastic.api import (
    cross_rank,
    cross_size,
    current_worker,
    init,
    local_rank,
    local_size,
    rank,
    size,
    slot_info,
)
from lightning_elastic.import_hook import call_after_import
from lightning_elastic.errors import CollectiveError, ElasticError, HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.run import run
from lightning_elastic.sampler import ElasticSampler
from lightning_elastic.state import ObjectState, State, TorchState
from lightning_elastic.worker import ElasticWorker, SlotInfo

__version__ = "0.1.0"

_LIGHTNING_NAMES = ("ElasticCallback", "ElasticStrategy", "ScaleLearningRate")


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        from lightning_elastic import lightning as integration

        return getattr(integration, name)
    raise AttributeError(f"module 'lightning_elastic' has no attribute {name!r}")


def _register_with(module: ModuleType) -> None:
    from lightning_elastic.lightning.registration import register_strategy

    register_strategy(module.__name__)


call_after_import("lightning.pytorch", _register_with)
call_after_import("pytorch_lightning", _register_with)

__all__ = [
    "CollectiveError",
    "ElasticCallback",
    "ElasticStrategy",
    "ScaleLearningRate",
    "ElasticError",
    "ElasticSampler",
    "ElasticWorker",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "RendezvousError",
    "SlotInfo",
    "State",
    "TorchState",
    "cross_rank",
    "cross_size",
    "current_worker",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "run",
    "size",
    "slot_info",
]
