"""lightning-elastic: elastic, fault-tolerant training for PyTorch Lightning and plain PyTorch.

Worker side. ``import lightning_elastic as le``; ``le.init()``; wrap the training function
in ``@le.run`` with a ``le.TorchState``; ``state.commit()`` every few batches.
"""

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
from lightning_elastic.errors import CollectiveError, ElasticError, HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.run import run
from lightning_elastic.sampler import ElasticSampler
from lightning_elastic.state import ObjectState, State, TorchState
from lightning_elastic.worker import ElasticWorker, SlotInfo

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
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
